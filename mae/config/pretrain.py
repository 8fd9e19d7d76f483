"""`mae pretrain`'s configuration: the masked autoencoder, its unlabeled images, AdamW, the loop and the k-NN
monitor; and the demo's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from mae.config.fields import IMAGENET_MEAN, IMAGENET_STD, crop_scale, ranged, ruled
from mae.config.sections import AdamWConfig, LoopConfig, SourceConfig, TrainingConfig, WorkersConfig


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
class DataConfig(WorkersConfig, SourceConfig):
    """Unlabeled images for pretraining."""

    streaming: bool = False
    """Stream hf:NAME[:split] (a `datasets` IterableDataset, split over processes and workers) instead of
    downloading it whole; resumes from each worker's position (docs/data.md: what streaming guarantees)."""
    crop_scale: tuple[float, float] = crop_scale((0.2, 1.0))
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


@dataclass(frozen=True)
class OptimConfig(AdamWConfig):
    """AdamW with per-step warm-up then cosine decay (the paper's pretraining: blr 1.5e-4, betas 0.9, 0.95)."""


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


# Settings applied under the user's own options when `mae pretrain` runs on the demo images, so that the first
# command a new user types finishes in about a minute on a 2-core CPU: 112 steps of batch 32 (docs/pretraining.md:
# how long it takes, and what it reaches).
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
