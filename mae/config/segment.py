"""The configuration of `mae segment`: a pretrained encoder, images with per-pixel masks, a head on the patch
tokens (the frozen-encoder probe or a decoder that fine-tunes the encoder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from mae.config.downstream import FinetuneOptimConfig
from mae.config.fields import ranged, ruled
from mae.config.sections import (
    LoopConfig,
    NormalisationConfig,
    PretrainedConfig,
    SourceConfig,
    TrainingConfig,
    WorkersConfig,
)


@dataclass(frozen=True)
class SegmentDataConfig(WorkersConfig, NormalisationConfig, SourceConfig):
    """Images and their masks."""

    path: str | None = None
    """Training data: a folder with images/NAME.<ext> and masks/NAME.png (pixel value = class index, 255 = ignore;
    palette PNGs read as their indices) and optionally classes.txt (one class name a line); or a `datasets` dataset
    (a `save_to_disk` folder or hf:NAME[:split]) with an image column and a mask column."""
    val_path: str | None = None
    """Validation data (the same forms, the same classes); null holds out --data.val_fraction of the training
    images."""
    mask_column: str | None = None
    """Mask column of a `datasets` source (images of class indices, or H x W integer arrays); null picks a column
    named mask, label, annotation, segmentation or semantic_mask, else the Image column other than the images'."""
    val_fraction: float = ranged(0.1, gt=0, lt=1)
    """Fraction of --data.path held out for validation when there is no --data.val_path (seeded)."""
    num_classes: int | None = ranged(None, ge=1)
    """Class count when the data does not name its classes (classes.txt, a ClassLabel in the mask column); null =
    the largest index in the training masks + 1."""


@dataclass(frozen=True)
class SegmentModelConfig:
    """The encoder under the head."""

    img_size: Union[int, tuple[int, int], None] = ranged(None, ge=1)  # noqa: UP007 (jsonargparse reads the Union)
    """Input size (the sliding window's); null = the pretrained encoder's (a different size resamples the
    position embedding)."""
    drop_path: float = ranged(0.1, ge=0, lt=1)
    """Stochastic depth rate of the encoder (a head that trains it)."""
    frozen_blocks: int = ranged(0, ge=0)
    """Keep the stem and the first N blocks as pretrained (a head that trains the encoder); 0 trains every layer."""


@dataclass(frozen=True)
class SegmentAugConfig:
    """Augmentations that move the image and its mask together."""

    scale: tuple[float, float] = ruled((0.5, 2.0), lambda v: len(v) == 2 and 0 < v[0] <= v[1], "0 < min <= max")
    """Random rescale of each training image, relative to the size that just covers the input, before a random
    crop of the input size (mmsegmentation's ratio range)."""
    hflip: float = ranged(0.5, ge=0, le=1)
    """Probability of a horizontal flip."""


@dataclass(frozen=True)
class SegmentConfig(PretrainedConfig, TrainingConfig):
    """mae segment."""

    head: str = "linear"
    """linear: BatchNorm + 1x1 conv on the frozen encoder's patch tokens (the probe); progressive: a SETR-PUP
    decoder (conv + 2x upsampling stages) that fine-tunes the encoder with layer decay; or a registered head."""
    model: SegmentModelConfig = field(default_factory=SegmentModelConfig)
    data: SegmentDataConfig = field(default_factory=SegmentDataConfig)
    aug: SegmentAugConfig = field(default_factory=SegmentAugConfig)
    # The MAE paper's ADE20K fine-tuning: AdamW lr 1e-4 at batch 16 (blr 1.6e-3), layer decay 0.65, weight decay
    # 0.05, betas 0.9, 0.999.
    optim: FinetuneOptimConfig = field(
        default_factory=lambda: FinetuneOptimConfig(
            blr=1.6e-3, min_lr=1e-6, warmup_epochs=2.0, betas=(0.9, 0.999), layer_decay=0.65
        )
    )
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(epochs=40, batch_size=16, eval_every=1))
