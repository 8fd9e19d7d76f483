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
    preview_every: int = 20
    """Epochs between reconstruction previews (one is always written at the end)."""
    max_nonfinite_steps: int = 20
    """Consecutive non-finite losses that stop the run."""
    log_with: str = "auto"
    """Accelerate tracker: auto (tensorboard when installed), none, tensorboard, wandb, ..."""
    progress: bool = True
    """Show a progress bar on the main process."""


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    output_dir: str = "outputs/pretrain"
    """Where config.yaml, metrics.jsonl, checkpoints, previews and encoder.safetensors go."""
    seed: int = 0
    """Seeds the weights, and each sample's crop and mask through (seed, epoch, index)."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in output_dir; never: start over; or a checkpoint path."""


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
    "loop.preview_every": 20,
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
