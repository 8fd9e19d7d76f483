"""The sections and fields that several stages share, each defined (and its `--help` text written) once: a stage's
section inherits the parts it reads and nothing else.

Dataclasses order the fields of several bases from the last base to the first, so a section lists its bases in
the reverse of the order its options should read in (`class X(Workers, Source)`: path, image_column, num_workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from mae.config.fields import ranged


@dataclass(frozen=True)
class ImageColumnConfig:
    """Which column of a `datasets` source holds the images."""

    image_column: str | None = None
    """Image column of a `datasets` source (images, arrays, or image file paths as text); null picks the first Image
    feature."""


@dataclass(frozen=True)
class ColumnsConfig(ImageColumnConfig):
    """Which columns of a `datasets` source hold the images and the labels."""

    label_column: str | None = None
    """Label column of a `datasets` source; null picks the first ClassLabel, or 'label'."""


@dataclass(frozen=True)
class PathConfig:
    """Where the images are."""

    path: str | None = None
    """An image folder (any nesting), a `save_to_disk` folder, hf:NAME[:split], or tar shards (a folder with
    index.json from `mae shard`, a brace pattern such as /data/train-{000000..000127}.tar, or URLs); null = demo
    images."""


@dataclass(frozen=True)
class SourceConfig(ImageColumnConfig, PathConfig):
    """Images from one source."""


@dataclass(frozen=True)
class LabeledSourceConfig(ColumnsConfig, PathConfig):
    """Images, labeled or not, from one source."""


@dataclass(frozen=True)
class WorkersConfig:
    """How the images are loaded."""

    num_workers: int = ranged(2, ge=0)
    """DataLoader worker processes per process (0 = load in the main process)."""


@dataclass(frozen=True)
class NormalisationConfig:
    """The normalisation of pretrained weights, unless given."""

    mean: tuple[float, ...] | None = None
    """Normalisation mean, one per channel; null = what the weights were pretrained with (their run's config.yaml,
    or the file's metadata)."""
    std: tuple[float, ...] | None = ranged(None, gt=0)
    """Normalisation std, one per channel; null = what the weights were pretrained with (their run's config.yaml,
    or the file's metadata)."""


@dataclass(frozen=True)
class BatchLoopConfig:
    """How the images go through the model."""

    batch_size: int = ranged(64, ge=1)
    """Images per batch on each process (in training, per micro-step)."""


@dataclass(frozen=True)
class PrecisionLoopConfig(BatchLoopConfig):
    """Batches and the precision they are computed in."""

    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto = on a GPU bf16 where it supports bf16, else fp16; on a CPU bf16 where its products were timed
    >= 1.25x fp32, else none (fp32)."""


@dataclass(frozen=True)
class EncodeLoopConfig(PrecisionLoopConfig):
    """Batches, precision and kernels of the network that runs."""

    attention: Literal["auto", "fused", "math"] = "auto"
    """Attention kernel: fused (SDPA) or math (explicit matmuls); auto = math for bf16 on a CPU, where measured
    faster (docs/speed.md), else fused."""
    compile: Union[bool, Literal["auto"]] = "auto"  # noqa: UP007 (jsonargparse reads the Union)
    """torch.compile the network that runs (the MAE, the fine-tuned ViT, the probe, the k-NN encoder); the first
    step's time (compilation included) is printed. auto: on a GPU, not on a CPU (docs/speed.md: what it gains
    where)."""


@dataclass(frozen=True)
class LoopConfig(EncodeLoopConfig):
    """The training loop: length, batches, precision, logging and checkpoints."""

    epochs: int = ranged(800, ge=1)
    """Passes over the training data."""
    accum_steps: int = ranged(1, ge=1)
    """Micro-steps per optimizer step (effective batch = batch_size x accum_steps x processes)."""
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


@dataclass(frozen=True)
class ScheduleConfig:
    """A learning rate scaled by the batch, with per-step warm-up then cosine decay."""

    blr: float = ranged(1.5e-4, gt=0)
    """Base learning rate: lr = blr x effective batch / 256."""
    lr: float | None = ranged(None, gt=0)
    """Absolute learning rate; overrides blr when set."""
    min_lr: float = ranged(0.0, ge=0)
    """Floor of the cosine schedule."""
    weight_decay: float = ranged(0.05, ge=0)
    """Weight decay (AdamW's decoupled); none on biases, norms, position embeddings and tokens."""
    warmup_epochs: float = ranged(40.0, ge=0)
    """Linear warm-up length, applied per step; a warm-up as long as the run never reaches the peak lr (warned)."""


@dataclass(frozen=True)
class AdamWConfig(ScheduleConfig):
    """AdamW with per-step warm-up then cosine decay."""

    betas: tuple[float, float] = ranged((0.9, 0.95), ge=0, lt=1)
    """AdamW's moment decay rates."""
    clip_grad: float | None = ranged(None, gt=0)
    """Clip the global gradient norm to this value; null = no clipping (the paper's choice)."""


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
