"""Optimizers and the learning-rate schedule shared by the training stages.

The lr is `blr x effective batch / 256` (the paper's scaling rule), warmed up linearly per step, then
decayed by a half-cycle cosine to `min_lr`. Stage-specific optimizers (the probe's LARS/SGD) live with
their stage; the schedule drives them all through each group's `lr_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def effective_batch(cfg: Any, processes: int) -> int:
    """Images per optimizer step: batch size x accumulation steps x processes."""
    return cfg.loop.batch_size * cfg.loop.accum_steps * processes


def base_lr(cfg: Any, processes: int) -> float:
    """The absolute lr: `--optim.lr` when set, else blr x effective batch / 256."""
    return cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.blr * effective_batch(cfg, processes) / 256


def lr_at(step: int, *, base_lr: float, total_steps: int, warmup_steps: int, min_lr: float = 0.0) -> float:
    """The learning rate for optimizer step `step` (0-based).

    The official MAE's per-step formula in its order of operations (timm's CosineLRScheduler draws the
    same curve, but rounds differently in the last bit, and resumed runs compare bit for bit)."""
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """A run's lr schedule, in optimizer steps."""

    base_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def lr(self, step: int) -> float:
        return lr_at(
            step,
            base_lr=self.base_lr,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            min_lr=self.min_lr,
        )

    @property
    def peak(self) -> float:
        """The highest lr the run reaches: the base lr, unless the warm-up outlasts the run."""
        return self.lr(min(self.warmup_steps, max(0, self.total_steps - 1)))


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr to `lr x lr_scale`; the scale carries e.g. layer-wise decay, so it
    holds whichever schedule drives the optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], **kwargs: Any):
    """timm's AdamW parameter groups (no decay on biases, norms, `no_weight_decay()`), with the fused
    kernel where torch has it: one kernel per step instead of a dozen per parameter."""
    from timm.optim import create_optimizer_v2

    try:
        return create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay, betas=betas, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # a device or dtype without the fused kernel
        return create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay, betas=betas, **kwargs)
