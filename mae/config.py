"""Typed, frozen configuration: the single source of truth for every stage.

Defaults are the paper's recipe (He et al., 2021, Table 8). A recipe YAML states only what
differs; the command line overrides it with dotted keys. Derived values (effective batch,
absolute learning rate) are computed where used and logged, never written back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Union

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ConfigError(ValueError):
    """A bad option value; the message names the option, the value and what is allowed."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mae_vit_base_patch16"
    """A preset (`mae.list_presets()`); the paper's headline model is mae_vit_large_patch16."""
    img_size: Union[int, tuple[int, int]] = 224  # noqa: UP007 (jsonargparse reads the Union)
    """Input size: an int or [H, W]; a multiple of the patch size."""
    patch_size: int | None = None
    """Patch size; null keeps the preset's."""
    embed_dim: int | None = None
    """Encoder width; null keeps the preset's (likewise the five below)."""
    depth: int | None = None
    num_heads: int | None = None
    decoder_embed_dim: int | None = None
    decoder_depth: int | None = None
    decoder_num_heads: int | None = None
    mask_ratio: float = 0.75
    """Fraction of patches removed per sample; 75% is the paper's optimum."""
    norm_pix_loss: bool = True
    """Regress per-patch normalised pixels (better representations, paper Table 1d)."""
    grad_checkpointing: bool = False
    """Recompute encoder activations in backward: less memory, ~30% more compute."""


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    """An image folder (any nesting), a `save_to_disk` folder, or hf:NAME[:split]; null = demo images."""
    image_column: str | None = None
    """Image column of a `datasets` source; null picks the first Image feature."""
    crop_scale: tuple[float, float] = (0.2, 1.0)
    """RandomResizedCrop area range (the paper's 0.2-1.0)."""
    hflip: bool = True
    """Random horizontal flip."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    num_workers: int = 2
    """DataLoader worker processes per training process."""


@dataclass(frozen=True)
class OptimConfig:
    blr: float = 1.5e-4
    """Base learning rate: lr = blr x effective batch / 256."""
    lr: float | None = None
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    weight_decay: float = 0.05
    """AdamW decoupled weight decay; none on biases, norms, position embeddings and tokens."""
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_epochs: float = 40.0
    """Linear warm-up length, applied per step."""
    clip_grad: float | None = None
    """Clip the global gradient norm to this value; null = no clipping (the paper's choice)."""


@dataclass(frozen=True)
class LoopConfig:
    epochs: int = 800
    batch_size: int = 64
    """Images per process per micro-step."""
    accum_steps: int = 1
    """Micro-steps per optimizer step (effective batch = batch_size x accum_steps x processes)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto = bf16 where the hardware has it (recent GPUs, CPUs with AVX512-BF16/AMX), else fp32."""
    log_every: int = 20
    """Optimizer steps between metrics lines."""
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (one is always written at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    eval_every: int = 20
    """Epochs between evaluations (pretraining: reconstruction previews); one always runs at the end."""
    max_nonfinite_steps: int = 20
    """Consecutive non-finite losses that stop the run."""
    log_with: str = "auto"
    """Accelerate tracker: auto (tensorboard when installed), none, tensorboard, wandb, ..."""
    progress: bool = True
    """Show a progress bar on the main process."""
    attention: Literal["auto", "fused", "math"] = "auto"
    """Attention kernel: fused (SDPA) or math (explicit matmuls); auto = math for bf16 on a CPU, where
    measured faster (scripts/benchmark.py), else fused."""
    compile: bool = False
    """torch.compile the network that runs (the MAE, the fine-tuned ViT, the probe, the k-NN encoder). On 2 CPU
    cores (scripts/benchmark.py): the small Fashion-MNIST ViT's step 1.14-1.22x faster (a whole run ~+5%: the
    loader shares the cores), ViT-S no faster; compiling takes ~15 s to a minute."""


@dataclass(frozen=True)
class MonitorConfig:
    knn_data: str | None = None
    """A labeled set (class folders or a labeled dataset): k-NN top-1 of the encoder on it at every evaluation."""
    knn_val_fraction: float = 0.2
    """Part of --monitor.knn_data that queries the rest (seeded)."""
    knn_k: int = 20
    knn_temperature: float = 0.07


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    output_dir: str = "outputs/pretrain"
    """Where config.yaml, metrics.jsonl, checkpoints, previews and encoder.safetensors go."""
    seed: int = 0
    """Seeds the weights, and each sample's crop and mask through (seed, epoch, index)."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in output_dir; never: start over; or a checkpoint path."""


@dataclass(frozen=True)
class LabeledDataConfig:
    path: str | None = None
    """Labeled training data: a folder with one subfolder per class, a `save_to_disk` folder, or hf:NAME[:split]."""
    val_path: str | None = None
    """Labeled validation data (same forms); null holds out --data.val_fraction of the training data."""
    val_fraction: float = 0.1
    """Fraction of --data.path held out for validation when there is no --data.val_path (seeded)."""
    image_column: str | None = None
    """Image column of a `datasets` source; null picks the first Image feature."""
    label_column: str | None = None
    """Label column of a `datasets` source; null picks the first ClassLabel, or 'label'."""
    mean: tuple[float, float, float] | None = None
    """Normalisation mean; null = what the encoder was pretrained with."""
    std: tuple[float, float, float] | None = None
    """Normalisation std; null = what the encoder was pretrained with."""
    crop_pct: float = 0.875
    """Evaluation: resize to img_size / crop_pct, then centre-crop img_size."""
    num_workers: int = 2
    """DataLoader worker processes per training process."""


@dataclass(frozen=True)
class ClassifierModelConfig:
    img_size: Union[int, tuple[int, int], None] = None  # noqa: UP007 (jsonargparse reads the Union)
    """Input size; null = the pretrained encoder's (a different size resamples the position embedding)."""
    pool: Literal["token", "avg"] = "avg"
    """Features: the cls token, or the average of the patch tokens."""
    drop_path: float = 0.1
    """Stochastic depth rate (fine-tuning)."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay (e.g. 0.9999); evaluated and exported."""


@dataclass(frozen=True)
class ProbeOptimConfig:
    blr: float = 0.1
    """Base learning rate: lr = blr x effective batch / 256 (the paper's linear probe: 0.1 with LARS)."""
    lr: float | None = None
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = 0.0
    weight_decay: float = 0.0
    warmup_epochs: float = 10.0
    momentum: float = 0.9
    """LARS / SGD momentum."""
    optimizer: Literal["lars", "sgd", "adamw"] = "lars"
    """lars is the paper's (for batches in the thousands); at small batches its trust ratio makes tiny steps,
    and sgd or adamw train the head in far fewer steps."""


@dataclass(frozen=True)
class FinetuneOptimConfig:
    blr: float = 1e-3
    """Base learning rate: lr = blr x effective batch / 256 (5e-4 for the paper's norm-pix ViT-B)."""
    lr: float | None = None
    min_lr: float = 1e-6
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    layer_decay: float = 0.75
    """Layer-wise lr decay: block i trains at lr x decay^(depth + 1 - (i + 1))."""
    warmup_epochs: float = 5.0
    clip_grad: float | None = None


@dataclass(frozen=True)
class AugmentConfig:
    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    """timm RandAugment policy; null turns it off."""
    reprob: float = 0.25
    """Random-erasing probability."""
    mixup: float = 0.8
    cutmix: float = 1.0
    smoothing: float = 0.1
    """Label smoothing."""
    crop_scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop area range."""


@dataclass(frozen=True)
class LinprobeConfig:
    pretrained: str | None = None
    """An encoder export, a pretraining output folder, or any checkpoint `load_pretrained` reads."""
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
    output_dir: str = "outputs/linprobe"
    seed: int = 0
    resume: str = "auto"


@dataclass(frozen=True)
class FinetuneConfig:
    pretrained: str | None = None
    """An encoder export, a pretraining output folder, any checkpoint `load_pretrained` reads; none = from scratch."""
    model: ClassifierModelConfig = field(default_factory=ClassifierModelConfig)
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    optim: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    aug: AugmentConfig = field(default_factory=AugmentConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=100, batch_size=64, eval_every=1))
    output_dir: str = "outputs/finetune"
    seed: int = 0
    resume: str = "auto"


@dataclass(frozen=True)
class KnnConfig:
    pretrained: str | None = None
    """An encoder export, a pretraining output folder, or any checkpoint `load_pretrained` reads."""
    model: ClassifierModelConfig = field(default_factory=lambda: ClassifierModelConfig(pool="token", drop_path=0.0))
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=1, batch_size=256))
    k: int = 20
    """Neighbours that vote."""
    temperature: float = 0.07
    """Votes are weighted by exp(cosine similarity / temperature)."""
    output_dir: str = "outputs/knn"
    seed: int = 0
    resume: str = "never"


# Settings applied under the user's own options when `mae pretrain` runs on the demo images,
# so the first command a new user types finishes in a couple of minutes on a laptop CPU.
DEMO_OVERRIDES: dict[str, Any] = {
    "model.name": "mae_vit_tiny_patch16",
    "model.img_size": 64,
    "model.patch_size": 8,
    "optim.blr": 1.5e-3,
    "optim.warmup_epochs": 2.0,
    "loop.epochs": 40,
    "loop.batch_size": 32,
    "loop.eval_every": 20,
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
