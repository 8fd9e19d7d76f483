"""The configuration of the stages that start from a pretrained encoder and labeled images: `mae linprobe`,
`mae finetune` and `mae knn`. Each holds only the sections it reads: k-NN trains nothing (no training loop), the
probe trains a head alone (no fine-tuning options)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from mae.config.fields import crop_scale, ranged
from mae.config.sections import (
    AdamWConfig,
    EncodeLoopConfig,
    LabeledSourceConfig,
    LoopConfig,
    NormalisationConfig,
    PretrainedConfig,
    RunConfig,
    ScheduleConfig,
    TrainingConfig,
    WorkersConfig,
)

# At effective batches below this, LARS's trust ratio makes tiny steps: the probe's `auto` takes SGD there.
LARS_MIN_BATCH = 256


@dataclass(frozen=True)
class LabeledDataConfig(WorkersConfig, NormalisationConfig, LabeledSourceConfig):
    """Labeled images for probing, fine-tuning and k-NN."""

    path: str | None = None
    """Labeled training data: a folder with one subfolder per class, a `save_to_disk` folder, hf:NAME[:split], or
    labeled tar shards (`mae shard` of any of these; a folder with index.json, a brace pattern or URLs)."""
    val_path: str | None = None
    """Labeled validation data (same forms); null holds out --data.val_fraction of the training data."""
    val_fraction: float = ranged(0.1, gt=0, lt=1)
    """Fraction of --data.path held out for validation when there is no --data.val_path (seeded)."""
    streaming: bool = False
    """Stream hf:NAME[:split] (and an hf: --data.val_path) instead of downloading it whole: each process reads
    its part; needs --data.val_path (a stream cannot be split) and a ClassLabel label column."""
    crop_pct: float = ranged(0.875, gt=0, le=1)
    """Evaluation: resize to img_size / crop_pct, then centre-crop img_size."""


@dataclass(frozen=True)
class ProbeModelConfig:
    """The frozen encoder's input and features."""

    img_size: Union[int, tuple[int, int], None] = ranged(None, ge=1)  # noqa: UP007 (jsonargparse reads the Union)
    """Input size; null = the pretrained encoder's (a different size resamples the position embedding)."""
    pool: Literal["token", "avg"] = "token"
    """Features: the cls token, or the average of the patch tokens."""


@dataclass(frozen=True)
class FinetuneModelConfig(ProbeModelConfig):
    """The ViT built from the pretrained encoder, all of it trained."""

    drop_path: float = ranged(0.1, ge=0, lt=1)
    """Stochastic depth rate."""
    frozen_blocks: int = ranged(0, ge=0)
    """Keep the stem (patch embedding, tokens, positions) and the first N blocks as pretrained (the paper's partial
    fine-tuning): no backward pass through them; 0 trains every layer."""
    ema_decay: float | None = ranged(None, gt=0, lt=1)
    """Keep an exponential moving average of the weights with this decay (e.g. 0.9999); evaluated and exported."""
    head_init: Literal["probe", "random"] = "probe"
    """probe = start the head from a linear probe fitted on the frozen features it will see (LP-FT, Kumar et al.
    2022; its top-1 is logged as the starting point); random = the paper's near-zero init."""


@dataclass(frozen=True)
class ProbeOptimConfig(ScheduleConfig):
    """The linear probe's optimizer, with per-step warm-up then cosine decay."""

    momentum: float = ranged(0.9, ge=0, lt=1)
    """Momentum of the LARS or SGD update (the paper's linear probe: 0.9); AdamW ignores it."""
    optimizer: Literal["auto", "lars", "sgd", "adamw"] = "auto"
    """auto: the paper's LARS at an effective batch of 256 or more, SGD (same lr) below, where LARS's trust ratio
    makes tiny steps (docs/evaluation.md: what it reached there)."""


@dataclass(frozen=True)
class FinetuneOptimConfig(AdamWConfig):
    """AdamW with layer-wise lr decay, per-step warm-up then cosine decay."""

    layer_decay: float = ranged(0.75, gt=0, le=1)
    """Layer-wise lr decay: block i trains at lr x decay^(depth + 1 - (i + 1)); 1 = off."""


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
    crop_scale: tuple[float, float] = crop_scale((0.08, 1.0))
    """RandomResizedCrop area range."""


@dataclass(frozen=True)
class LinprobeConfig(PretrainedConfig, TrainingConfig):
    """mae linprobe."""

    model: ProbeModelConfig = field(default_factory=ProbeModelConfig)
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    # The paper's linear probe: blr 0.1, no weight decay, 10 warm-up epochs of 90.
    optim: ProbeOptimConfig = field(
        default_factory=lambda: ProbeOptimConfig(blr=0.1, weight_decay=0.0, warmup_epochs=10.0)
    )
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

    model: FinetuneModelConfig = field(default_factory=lambda: FinetuneModelConfig(pool="avg"))
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    # The paper's fine-tuning: blr 1e-3 (5e-4 for its norm-pix ViT-B), min lr 1e-6, betas 0.9, 0.999, 5 warm-up
    # epochs of 100.
    optim: FinetuneOptimConfig = field(
        default_factory=lambda: FinetuneOptimConfig(blr=1e-3, min_lr=1e-6, warmup_epochs=5.0, betas=(0.9, 0.999))
    )
    aug: AugmentConfig = field(default_factory=AugmentConfig)
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=100, batch_size=64, eval_every=1))


@dataclass(frozen=True)
class KnnConfig(PretrainedConfig, RunConfig):
    """mae knn."""

    model: ProbeModelConfig = field(default_factory=ProbeModelConfig)
    data: LabeledDataConfig = field(default_factory=LabeledDataConfig)
    loop: EncodeLoopConfig = field(default_factory=lambda: EncodeLoopConfig(batch_size=256))
    k: int = ranged(20, ge=1)
    """Neighbours that vote."""
    temperature: float = ranged(0.07, gt=0)
    """Votes are weighted by exp(cosine similarity / temperature)."""
