"""Typed, frozen configuration: the single source of truth for every stage.

Defaults are the paper's recipe (He et al., 2021, Table 8). A recipe YAML states only what
differs; the command line overrides it with dotted keys. Derived values (effective batch,
absolute learning rate) are computed where used and logged, never written back.

Each field carries its own constraint (`ranged` / `ruled`), checked by `check_config` as soon as
the options are parsed, in every stage alike; the docstring under each field is its `--help` text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Union

from mae.errors import ConfigError  # noqa: F401 - stages and tests import it from here

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Rule:
    """What values a field accepts: `ok(value)` and the words that say it (`text`)."""

    ok: Callable[[Any], bool]
    text: str


def ruled(default: Any, ok: Callable[[Any], bool], text: str) -> Any:
    """A dataclass field whose non-null values must satisfy `ok`."""
    return field(default=default, metadata={"rule": Rule(ok, text)})


def ranged(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None
) -> Any:
    """A numeric field (or a tuple of numbers, each checked) within the given bounds."""

    def ok(value: Any) -> bool:
        values = value if isinstance(value, (tuple, list)) else (value,)
        return all(
            (ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le) and (lt is None or v < lt)
            for v in values
        )

    low = f"[{ge:g}" if ge is not None else (f"({gt:g}" if gt is not None else None)
    high = f"{le:g}]" if le is not None else (f"{lt:g})" if lt is not None else None)
    if low and high:
        text = f"in {low}, {high}"
    elif low:
        text = (">= " if ge is not None else "> ") + low[1:]
    else:
        text = ("<= " if le is not None else "< ") + high[:-1]
    return ruled(default, ok, text)


def _crop_range(v: Any) -> bool:
    return len(v) == 2 and 0 < v[0] <= v[1] <= 1


def check_config(cfg: Any, prefix: str = "") -> None:
    """Every field's own constraint, recursively; ConfigError names the first option out of range."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            check_config(value, f"{prefix}{f.name}.")
            continue
        rule = f.metadata.get("rule")
        if rule is not None and value is not None and not rule.ok(value):
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(f"--{prefix}{f.name} {shown}: must be {rule.text}")


@dataclass(frozen=True)
class ModelConfig:
    """The masked autoencoder to pretrain."""

    name: str = "mae_vit_base_patch16"
    """A preset (`mae.list_presets()`); the paper's headline model is mae_vit_large_patch16."""
    img_size: Union[int, tuple[int, int]] = ranged(224, ge=1)  # noqa: UP007 (jsonargparse reads the Union)
    """Input size: an int or [H, W]; a multiple of the patch size."""
    patch_size: int | None = ranged(None, ge=1)
    """Patch size; null keeps the preset's."""
    in_chans: int = ranged(3, ge=1)
    """Image channels: 3 for RGB (images of any mode are converted), 1 for grayscale (8- or 16-bit), N for
    multispectral TIFF or .npy arrays (H x W x N); a file with another channel count is an error."""
    embed_dim: int | None = ranged(None, ge=4)
    """Encoder width (a multiple of 4 and of the head count); null keeps the preset's."""
    depth: int | None = ranged(None, ge=1)
    """Encoder blocks; null keeps the preset's."""
    num_heads: int | None = ranged(None, ge=1)
    """Encoder attention heads; null keeps the preset's."""
    mlp_ratio: float | None = ranged(None, gt=0)
    """Encoder MLP width / embed_dim (timm's mlp_ratio; the presets' is 4); null keeps the preset's."""
    decoder_embed_dim: int | None = ranged(None, ge=4)
    """Decoder width (a multiple of 4 and of the decoder head count); null keeps the preset's."""
    decoder_depth: int | None = ranged(None, ge=0)
    """Decoder blocks; null keeps the preset's."""
    decoder_num_heads: int | None = ranged(None, ge=1)
    """Decoder attention heads; null keeps the preset's."""
    decoder_mlp_ratio: float | None = ranged(None, gt=0)
    """Decoder MLP width / decoder_embed_dim; null keeps the preset's (4)."""
    mask_ratio: float = ranged(0.75, ge=0, lt=1)
    """Fraction of patches removed per sample; 75% is the paper's optimum."""
    masking: str = "random"
    """Which patches a sample keeps: random (the paper's), block (BEiT's removed rectangles), inverse_block
    (data2vec 2.0's kept rectangles), grid (one patch of each 2x2 cell; mask ratio 0.75), or any registered
    with `mae.models.masking.register_mask`."""
    decoder: str = "mae"
    """mae: the paper's decoder (self-attention over every patch); cross: CrossMAE's (mask tokens attend to the
    encoder's tokens only, for --model.predict_ratio of the masked patches). The encoder export is the same."""
    predict_ratio: float = ranged(1.0, gt=0, le=1)
    """With --model.decoder cross: the fraction of the masked patches predicted (and in the loss)."""
    norm_pix_loss: bool = True
    """Regress per-patch normalised pixels (better representations, paper Table 1d)."""
    grad_checkpointing: bool = False
    """Recompute encoder activations in backward: less memory, ~30% more compute."""


@dataclass(frozen=True)
class DataConfig:
    """Unlabeled images for pretraining."""

    path: str | None = None
    """An image folder (any nesting), a `save_to_disk` folder, hf:NAME[:split], or tar shards (a folder with
    index.json from `mae shard`, a brace pattern such as /data/train-{000000..000127}.tar, or URLs); null = demo
    images."""
    image_column: str | None = None
    """Image column of a `datasets` source (images, arrays, or image file paths as text); null picks the first Image
    feature."""
    streaming: bool = False
    """Stream hf:NAME[:split] (a `datasets` IterableDataset, split over processes and workers) instead of
    downloading it whole; resumes from each worker's position (docs/data.md: what streaming guarantees)."""
    crop_scale: tuple[float, float] = ruled((0.2, 1.0), _crop_range, "0 < min <= max <= 1")
    """RandomResizedCrop area range (the paper's 0.2-1.0)."""
    hflip: bool = True
    """Random horizontal flip."""
    mean: Union[tuple[float, ...], Literal["auto"]] = IMAGENET_MEAN  # noqa: UP007 (jsonargparse reads the Union)
    """Per-channel normalisation mean (pixels in [0, 1]), one per channel; auto: measured on a seeded sample of the
    data at start (`mae stats`), then recorded in config.yaml and the export. The default, ImageNet's, serves 3
    channels; with any other --model.in_chans it is measured as auto."""
    std: Union[tuple[float, ...], Literal["auto"]] = ruled(  # noqa: UP007
        IMAGENET_STD, lambda v: v == "auto" or all(x > 0 for x in v), "> 0 for every channel, or auto"
    )
    """Per-channel normalisation std (pixels in [0, 1]), one per channel; auto (and the default beside another
    channel count than 3): measured like --data.mean."""
    preview_bands: tuple[int, int, int] | None = ranged(None, ge=0)
    """Which three channels the previews show as red, green, blue (more than 3 channels); null = the first three."""
    num_workers: int = ranged(2, ge=0)
    """DataLoader worker processes per training process (0 = load in the training process)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with per-step warm-up then cosine decay."""

    blr: float = ranged(1.5e-4, gt=0)
    """Base learning rate: lr = blr x effective batch / 256."""
    lr: float | None = ranged(None, gt=0)
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = ranged(0.0, ge=0)
    """Floor of the cosine schedule."""
    weight_decay: float = ranged(0.05, ge=0)
    """AdamW decoupled weight decay; none on biases, norms, position embeddings and tokens."""
    betas: tuple[float, float] = ranged((0.9, 0.95), ge=0, lt=1)
    """AdamW's moment decay rates (the paper's 0.9, 0.95)."""
    warmup_epochs: float = ranged(40.0, ge=0)
    """Linear warm-up length, applied per step; a warm-up as long as the run never reaches the peak lr (warned)."""
    clip_grad: float | None = ranged(None, gt=0)
    """Clip the global gradient norm to this value; null = no clipping (the paper's choice)."""


@dataclass(frozen=True)
class LoopConfig:
    """The training loop: length, batches, precision, logging and checkpoints."""

    epochs: int = ranged(800, ge=1)
    """Passes over the training data."""
    batch_size: int = ranged(64, ge=1)
    """Images per process per micro-step."""
    accum_steps: int = ranged(1, ge=1)
    """Micro-steps per optimizer step (effective batch = batch_size x accum_steps x processes)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto = bf16 where it is faster: GPUs that have it; CPUs where bf16 products were timed >= 1.25x fp32."""
    log_every: int = ranged(20, ge=1)
    """Optimizer steps between metrics lines."""
    checkpoint_every: int = ranged(500, ge=1)
    """Optimizer steps between checkpoints (one is always written at the end)."""
    keep_checkpoints: int = ranged(2, ge=1)
    """How many recent checkpoints to keep."""
    eval_every: int = ranged(20, ge=0)
    """Epochs between evaluations (pretraining: reconstruction previews); one always runs at the end; 0 = only then."""
    min_steps: int = ranged(0, ge=0)
    """Train at least this many optimizer steps: --loop.epochs grows on small data sets, the warm-up keeping its share
    of the run (0 = epochs alone)."""
    max_nonfinite_steps: int = ranged(20, ge=1)
    """Consecutive non-finite losses that stop the run."""
    log_with: str = "auto"
    """Accelerate tracker: auto (tensorboard when installed), none, tensorboard, wandb, ..."""
    progress: bool = True
    """Show a progress bar on the main process."""
    attention: Literal["auto", "fused", "math"] = "auto"
    """Attention kernel: fused (SDPA) or math (explicit matmuls); auto = math for bf16 on a CPU, where
    measured faster (scripts/benchmark.py), else fused."""
    compile: Union[bool, Literal["auto"]] = "auto"  # noqa: UP007 (jsonargparse reads the Union)
    """torch.compile the network that runs (the MAE, the fine-tuned ViT, the probe, the k-NN encoder); the first
    step's time (compilation included) is printed. auto: on a GPU, not on a CPU, where scripts/benchmark.py
    measured the small Fashion-MNIST ViT's step 1.14-1.22x faster but a whole 2-core run only ~+5% (the loader
    shares the cores), ViT-S no faster, for ~15 s to a minute of compiling."""


@dataclass(frozen=True)
class MonitorConfig:
    """k-NN accuracy of the encoder on a labeled set, watched during pretraining."""

    knn_data: str | None = None
    """A labeled set (class folders, a labeled dataset or labeled shards): k-NN top-1 of the encoder on it at every
    evaluation."""
    knn_val_fraction: float = ranged(0.2, gt=0, lt=1)
    """Part of --monitor.knn_data that queries the rest (seeded)."""
    knn_k: int = ranged(20, ge=1)
    """Neighbours that vote."""
    knn_temperature: float = ranged(0.07, gt=0)
    """Votes are weighted by exp(cosine similarity / temperature)."""


@dataclass(frozen=True)
class RunConfig:
    """What every stage that writes a run folder shares."""

    output_dir: str | None = None
    """Where the run writes config.yaml, metrics.jsonl, checkpoints and its weights; null = outputs/<stage>."""
    seed: int = ranged(0, ge=0)
    """Seeds everything random in the run: the weights of new layers, the validation split, and each sample's
    crop, mask and augmentation (drawn from seed, epoch and index, so any number of processes sees the same)."""


@dataclass(frozen=True)
class TrainingConfig(RunConfig):
    """A stage that trains: it checkpoints and resumes."""

    resume: str = "auto"
    """auto: continue from the latest checkpoint in output_dir; never: start over; or a checkpoint path."""


@dataclass(frozen=True)
class PretrainedConfig:
    """A stage that starts from a pretrained encoder."""

    pretrained: str | None = None
    """An encoder export, a pretraining output folder, any checkpoint `load_pretrained` reads, or random:PRESET
    (a random-init baseline, seeded by --seed)."""


@dataclass(frozen=True)
class PretrainConfig(TrainingConfig):
    """mae pretrain."""

    init: str | None = None
    """Start from these weights: any file or folder `load_pretrained` reads (an official .pth with or without its
    decoder, a transformers ViTMAE folder, a timm MAE encoder, this toolkit's exports and run folders). The decoder
    comes too when the file has one (else a fresh one, warned); step, optimizer and schedule start fresh. The
    architecture is the file's: --model options that differ from their defaults override it (a different
    --model.in_chans adapts the patch embedding, a different --model.img_size rebuilds the position tables)."""
    init_sha256: str | None = None
    """The sha256 of the --init weights, recorded by the run in config.yaml (given, it must match the file)."""
    export_decoder: bool = False
    """Also write the decoder beside encoder.safetensors at the end (decoder.safetensors), so that others can
    continue the pretraining with --init; timm reads the encoder file as before."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


@dataclass(frozen=True)
class LabeledDataConfig:
    """Labeled images for probing, fine-tuning and k-NN."""

    path: str | None = None
    """Labeled training data: a folder with one subfolder per class, a `save_to_disk` folder, hf:NAME[:split], or
    labeled tar shards (`mae shard` of any of these; a folder with index.json, a brace pattern or URLs)."""
    val_path: str | None = None
    """Labeled validation data (same forms); null holds out --data.val_fraction of the training data."""
    val_fraction: float = ranged(0.1, gt=0, lt=1)
    """Fraction of --data.path held out for validation when there is no --data.val_path (seeded)."""
    image_column: str | None = None
    """Image column of a `datasets` source (images, arrays, or image file paths as text); null picks the first Image
    feature."""
    label_column: str | None = None
    """Label column of a `datasets` source; null picks the first ClassLabel, or 'label'."""
    streaming: bool = False
    """Stream hf:NAME[:split] (and an hf: --data.val_path) instead of downloading it whole: each process reads
    its part; needs --data.val_path (a stream cannot be split) and a ClassLabel label column."""
    mean: tuple[float, ...] | None = None
    """Normalisation mean, one per channel; null = what the encoder was pretrained with."""
    std: tuple[float, ...] | None = ranged(None, gt=0)
    """Normalisation std, one per channel; null = what the encoder was pretrained with."""
    crop_pct: float = ranged(0.875, gt=0, le=1)
    """Evaluation: resize to img_size / crop_pct, then centre-crop img_size."""
    num_workers: int = ranged(2, ge=0)
    """DataLoader worker processes per training process (0 = load in the training process)."""


@dataclass(frozen=True)
class ClassifierModelConfig:
    """The ViT built from the pretrained encoder."""

    img_size: Union[int, tuple[int, int], None] = ranged(None, ge=1)  # noqa: UP007 (jsonargparse reads the Union)
    """Input size; null = the pretrained encoder's (a different size resamples the position embedding)."""
    pool: Literal["token", "avg"] = "avg"
    """Features: the cls token, or the average of the patch tokens."""
    drop_path: float = ranged(0.1, ge=0, lt=1)
    """Stochastic depth rate (fine-tuning)."""
    frozen_blocks: int = ranged(0, ge=0)
    """Fine-tuning: keep the stem (patch embedding, tokens, positions) and the first N blocks as pretrained (the
    paper's partial fine-tuning): no backward pass through them; 0 trains every layer."""
    ema_decay: float | None = ranged(None, gt=0, lt=1)
    """Keep an exponential moving average of the weights with this decay (e.g. 0.9999); evaluated and exported."""
    head_init: Literal["probe", "random"] = "probe"
    """Fine-tuning: probe = start the head from a linear probe fitted on the frozen features it will see (LP-FT,
    Kumar et al. 2022; its top-1 is logged as the starting point); random = the paper's near-zero init."""


# At effective batches below this, LARS's trust ratio makes tiny steps: the probe's `auto` takes SGD there.
LARS_MIN_BATCH = 256


@dataclass(frozen=True)
class ProbeOptimConfig:
    """The linear probe's optimizer, with per-step warm-up then cosine decay."""

    blr: float = ranged(0.1, gt=0)
    """Base learning rate: lr = blr x effective batch / 256 (the paper's linear probe: 0.1 with LARS)."""
    lr: float | None = ranged(None, gt=0)
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = ranged(0.0, ge=0)
    """Floor of the cosine schedule."""
    weight_decay: float = ranged(0.0, ge=0)
    """Weight decay of the linear layer's weights (never its bias)."""
    warmup_epochs: float = ranged(10.0, ge=0)
    """Linear warm-up length, applied per step."""
    momentum: float = ranged(0.9, ge=0, lt=1)
    """Momentum of the LARS or SGD update (the paper's linear probe: 0.9); AdamW ignores it."""
    optimizer: Literal["auto", "lars", "sgd", "adamw"] = "auto"
    """auto: the paper's LARS at an effective batch of 256 or more, SGD (same lr) below, where LARS's trust ratio
    makes tiny steps (batch 16: 41.7% top-1 with LARS, 94.4% with SGD on the same features)."""


@dataclass(frozen=True)
class FinetuneOptimConfig:
    """AdamW with layer-wise lr decay, per-step warm-up then cosine decay."""

    blr: float = ranged(1e-3, gt=0)
    """Base learning rate: lr = blr x effective batch / 256 (5e-4 for the paper's norm-pix ViT-B)."""
    lr: float | None = ranged(None, gt=0)
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = ranged(1e-6, ge=0)
    """Floor of the cosine schedule."""
    weight_decay: float = ranged(0.05, ge=0)
    """AdamW decoupled weight decay; none on biases, norms, position embeddings and tokens."""
    betas: tuple[float, float] = ranged((0.9, 0.999), ge=0, lt=1)
    """AdamW's moment decay rates."""
    layer_decay: float = ranged(0.75, gt=0, le=1)
    """Layer-wise lr decay: block i trains at lr x decay^(depth + 1 - (i + 1)); 1 = off."""
    warmup_epochs: float = ranged(5.0, ge=0)
    """Linear warm-up length, applied per step."""
    clip_grad: float | None = ranged(None, gt=0)
    """Clip the global gradient norm to this value; null = no clipping."""


@dataclass(frozen=True)
class AugmentConfig:
    """Fine-tuning augmentation (timm's create_transform and Mixup)."""

    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    """timm RandAugment policy; null turns it off."""
    reprob: float = ranged(0.25, ge=0, le=1)
    """Random-erasing probability."""
    mixup: float = ranged(0.8, ge=0)
    """Mixup alpha; 0 = off."""
    cutmix: float = ranged(1.0, ge=0)
    """CutMix alpha; 0 = off."""
    smoothing: float = ranged(0.1, ge=0, lt=1)
    """Label smoothing."""
    crop_scale: tuple[float, float] = ruled((0.08, 1.0), _crop_range, "0 < min <= max <= 1")
    """RandomResizedCrop area range."""


@dataclass(frozen=True)
class LinprobeConfig(PretrainedConfig, TrainingConfig):
    """mae linprobe."""

    model: ClassifierModelConfig = field(default_factory=lambda: ClassifierModelConfig(pool="token", drop_path=0.0))
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    optim: ProbeOptimConfig = field(default_factory=ProbeOptimConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=90, batch_size=256, eval_every=10))
    mode: Literal["auto", "cached", "augmented"] = "auto"
    """cached: encode once, train the head on stored features; augmented: the paper's crops through the encoder."""
    augment: bool = False
    """Random-resized-crop + flip (the paper's protocol); implies the augmented mode."""
    cache_dir: str | None = None
    """Keep cached features on disk here (memory-mapped) instead of in memory."""


@dataclass(frozen=True)
class FinetuneConfig(PretrainedConfig, TrainingConfig):
    """mae finetune."""

    model: ClassifierModelConfig = field(default_factory=ClassifierModelConfig)
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    optim: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    aug: AugmentConfig = field(default_factory=AugmentConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=100, batch_size=64, eval_every=1))


@dataclass(frozen=True)
class KnnConfig(PretrainedConfig, RunConfig):
    """mae knn."""

    model: ClassifierModelConfig = field(default_factory=lambda: ClassifierModelConfig(pool="token", drop_path=0.0))
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=1, batch_size=256))
    k: int = ranged(20, ge=1)
    """Neighbours that vote."""
    temperature: float = ranged(0.07, gt=0)
    """Votes are weighted by exp(cosine similarity / temperature)."""


@dataclass(frozen=True)
class VisualizeConfig:
    """mae visualize."""

    images: list[str]
    """Image files to show, or folders (the first 8 images of each, in name order)."""
    checkpoint: str | None = None
    """Reconstructions: a pretraining output folder, or any checkpoint `load_pretrained` reads."""
    pretrained: str | None = None
    """Attention maps (with --attention): an encoder export, an output folder, or any checkpoint."""
    attention: bool = False
    """Show the cls token's attention over the patches in the last block, per head and averaged."""
    output: str = "reconstructions.png"
    """Where the PNG grid goes."""
    mask_ratio: float | None = ranged(None, ge=0, lt=1)
    """Fraction of patches to mask; null = the model's."""
    masking: str | None = None
    """Mask generator (see mae pretrain --help); null = the run's (its config.yaml), else random."""
    bands: tuple[int, int, int] | None = ranged(None, ge=0)
    """Channels shown as red, green, blue for images of more than 3 channels; null = the run's preview bands."""
    seed: int = ranged(0, ge=0)
    """Seeds the masks."""


@dataclass(frozen=True)
class StatsDataConfig:
    """The images to measure."""

    path: str | None = None
    """An image folder, a `save_to_disk` folder, hf:NAME[:split] or tar shards (as mae pretrain reads them); null =
    demo images."""
    image_column: str | None = None
    """Image column of a `datasets` source (images, arrays, or image file paths as text); null picks the first Image
    feature."""


@dataclass(frozen=True)
class StatsModelConfig:
    """How the images are read."""

    in_chans: int | None = ranged(None, ge=1)
    """Channels per image, as in mae pretrain (3: RGB; 1: grayscale; N: multispectral); null = as many as the
    first readable file has (a 13-band .npy folder gives 13)."""


@dataclass(frozen=True)
class StatsConfig:
    """mae stats."""

    data: StatsDataConfig = field(default_factory=StatsDataConfig)
    model: StatsModelConfig = field(default_factory=StatsModelConfig)
    samples: int = ranged(1000, ge=1)
    """How many images (a seeded sample) to measure."""
    seed: int = ranged(0, ge=0)
    """Seeds the sample."""


@dataclass(frozen=True)
class ExportConfig:
    """mae export."""

    checkpoint: str
    """A pretraining output folder, a checkpoint, or any file `load_pretrained` reads."""
    output: str
    """The .safetensors file to write (the folder with --format hf-folder or --push_to_hub; the .onnx file with
    --format onnx)."""
    format: Literal["safetensors", "hf-folder", "onnx"] = "safetensors"
    """safetensors: one file; hf-folder: model.safetensors + timm config.json + model card; onnx: an ONNX model
    (encoder: pooled features and tokens; classifier: logits), batch axis free, checked with onnxruntime."""
    with_decoder: bool = False
    """Also write the MAE decoder beside the encoder (NAME.decoder.safetensors, or decoder.safetensors in an hf
    folder): load_pretrained of the export then reads the whole MAE back; timm reads the encoder file as before."""
    img_size: tuple[int, int] | None = ranged(None, ge=1)
    """Input size [H, W] of a checkpoint that does not record it (a non-square patch grid without metadata)."""
    opset: int = ranged(17, ge=14)
    """ONNX opset of --format onnx (17: LayerNorm as one op; onnxruntime >= 1.14)."""
    push_to_hub: str | None = None
    """OWNER/NAME: upload the hf folder written to --output to this Hugging Face model repo (token from HF_TOKEN
    or `hf auth login`); timm.create_model("hf-hub:OWNER/NAME", pretrained=True) then loads it."""
    private: bool = False
    """With --push_to_hub: create the repo private."""
    revision: str | None = None
    """With --push_to_hub: the branch to push to (created when missing); null = main."""
    license: str = "apache-2.0"
    """The license the model card states (a Hub license id: apache-2.0, mit, cc-by-4.0, other, ...)."""


@dataclass(frozen=True)
class ConvertConfig:
    """mae convert."""

    source: str
    """An official .pth, a transformers ViTMAE folder or file, a timm MAE encoder, or our own files."""
    output: str
    """The .safetensors file to write."""
    encoder_only: bool = False
    """Write only the encoder, as `mae export` does."""
    num_heads: int | None = ranged(None, ge=1)
    """Encoder head count, for widths that do not tell it."""
    decoder_num_heads: int | None = ranged(None, ge=1)
    """Decoder head count, for widths that do not tell it."""


@dataclass(frozen=True)
class ShardConfig:
    """mae shard."""

    source: str
    """What --data.path reads: an image folder (class subfolders give labeled shards), a `datasets` folder or
    hf:NAME[:split], or a shard set (to re-shard or pre-resize it)."""
    output: str
    """The folder to write the shards and their index.json into (new, or without an index)."""
    samples_per_shard: int = ranged(10_000, ge=1)
    """Samples per tar file (the last one holds the rest)."""
    max_size: int | None = ranged(None, ge=1)
    """Re-encode images whose longer side exceeds this many pixels down to it (aspect kept); null = store the
    files as they are. The originals are never modified."""
    labeled: bool | None = None
    """Write each sample's class (KEY.cls); null = when the source is labeled (class subfolders, a label column)."""
    image_column: str | None = None
    """Image column of a `datasets` source (images, arrays, or image file paths as text); null picks the first Image
    feature."""
    label_column: str | None = None
    """Label column of a `datasets` source; null picks the first ClassLabel (or `label`)."""
    shuffle: bool = True
    """Write the samples in a seeded random order (the reader shuffles within a few shards at a time)."""
    seed: int = ranged(0, ge=0)
    """Seeds the order."""


# Settings applied under the user's own options when `mae pretrain` runs on the demo images,
# so the first command a new user types finishes in about a minute on a 2-core CPU: 112 steps of batch 32.
# Measured on 2 idle cores of an AMD EPYC (AVX512-BF16, no AMX): 40 epochs at blr 1.5e-3 took 102 s and ended at a
# preview loss of 0.761; 16 at blr 3e-3 take 45 s and end at 0.762, the same grid (on a loaded machine, minutes).
DEMO_OVERRIDES: dict[str, Any] = {
    "model.name": "mae_vit_tiny_patch16",
    "model.img_size": 64,
    "model.patch_size": 8,
    "optim.blr": 3e-3,
    "optim.warmup_epochs": 2.0,
    "loop.epochs": 16,
    "loop.batch_size": 32,
    "loop.eval_every": 8,
    "loop.log_every": 10,
    "loop.checkpoint_every": 1000,
    "output_dir": "outputs/demo",
}


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-ready dict of a config (tuples as lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    return plain(asdict(cfg))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass(frozen=True)
class PredictDataConfig:
    """Images to classify, as one source."""

    path: str | None = None
    """Any image source mae reads (an image folder, labeled or not, a `save_to_disk` folder, hf:NAME[:split], tar
    shards); instead of --images."""
    image_column: str | None = None
    """Image column of a `datasets` source; null picks the first Image feature."""
    num_workers: int = ranged(2, ge=0)
    """DataLoader worker processes (0 = load in this process)."""


@dataclass(frozen=True)
class PredictLoopConfig:
    """How the images go through the model."""

    batch_size: int = ranged(64, ge=1)
    """Images per batch."""


@dataclass(frozen=True)
class PredictConfig:
    """mae predict."""

    pretrained: str | None = None
    """A classifier: a linprobe or finetune output folder, its classifier.safetensors, or an hf folder of one."""
    images: list[str] | None = None
    """Image files (or folders of images) to classify; or give --data.path."""
    data: PredictDataConfig = field(default_factory=PredictDataConfig)
    loop: PredictLoopConfig = field(default_factory=PredictLoopConfig)
    top_k: int = ranged(5, ge=1)
    """How many classes (and probabilities) per image, most probable first (at most the class count)."""
    output: str | None = None
    """Where the predictions go: a .csv (columns file, class, probability, then class_2, probability_2, ...) or a
    .json file; null prints them."""


@dataclass(frozen=True)
class AnomalyDataConfig:
    """The images to score."""

    path: str | None = None
    """Images to score: a folder (any nesting; class subfolders give labels), a `save_to_disk` folder, hf:NAME[:split]
    or tar shards; null = demo images. With a class `normal` or `good` (MVTec AD's test/good), or --normal, image
    AUROC and AUPR are reported; MVTec's ground_truth/<defect>/<name>_mask.png beside test/ give pixel AUROC."""
    image_column: str | None = None
    """Image column of a `datasets` source; null picks the first Image feature."""
    label_column: str | None = None
    """Label column of a `datasets` source; null picks the first ClassLabel, or 'label'."""
    mean: tuple[float, ...] | None = None
    """Normalisation mean, one per channel; null = the run's (its config.yaml, or the file's metadata)."""
    std: tuple[float, ...] | None = ranged(None, gt=0)
    """Normalisation std, one per channel; null = the run's (its config.yaml, or the file's metadata)."""
    num_workers: int = ranged(2, ge=0)
    """DataLoader worker processes per process (0 = load in the main process)."""


@dataclass(frozen=True)
class AnomalyConfig(PretrainedConfig, RunConfig):
    """mae anomaly."""

    data: AnomalyDataConfig = field(default_factory=AnomalyDataConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=1, batch_size=64, log_with="none"))
    score: Literal["recon", "knn", "gaussian", "both", "all"] = "recon"
    """recon: the MAE's reconstruction error (maps; local defects); knn: the encoder features' distance to the
    nearest training images; gaussian: their Mahalanobis distance to a Gaussian fitted to the training images'
    features (knn and gaussian: semantic outliers, no maps); both: recon and knn; all: the three
    (docs/anomaly.md: which when)."""
    masks: int = ranged(4, ge=2)
    """Complementary mask sets per image: each masks 1 - 1/K of the patches, every patch masked K - 1 times."""
    features: Literal["masked", "full", "positions"] = "masked"
    """--score knn/gaussian/both/all: the encoder's patch tokens averaged over the visible patches of each of the
    --masks sets, as in pretraining, then over the sets (masked), or over the whole image (full: for an encoder not
    pretrained by masking); --score gaussian also: the whole image's tokens one per patch position, each judged by
    a Gaussian of its own position, the distances averaged (positions: PaDiM's model; the best MAE score on
    one-class Fashion-MNIST; without recon, the maps are each patch's distance; memory: patches x width floats per
    training image)."""
    aggregate: Literal["topk_mean", "mean", "max"] = "topk_mean"
    """An image's reconstruction score from its map: the mean of its top --top_percent pixels, the mean, or the max."""
    top_percent: float = ranged(1.0, gt=0, le=100)
    """With --aggregate topk_mean: the share of the map's pixels (in percent) whose mean is the score."""
    train_path: str | None = None
    """--score knn/gaussian/both/all: the normal training images (any source); null = the run's own data.path."""
    k: int = ranged(5, ge=1)
    """--score knn/both/all: the nearest training images whose mean cosine distance is the score."""
    shrinkage: float = ranged(1e-3, gt=0)
    """--score gaussian/all: the Gaussian's covariance plus this times its mean variance on the diagonal."""
    normal: str | None = None
    """The class of --data.path that is normal (the others are anomalies); null = a class named normal or good."""
    save_maps: bool = True
    """Write maps/<name>.npy (the map at the model's input resolution) and maps/<name>.png (an overlay)."""
    figure_images: int = ranged(8, ge=1)
    """How many of the most anomalous images most_anomalous.png shows."""
