"""Learning-rate schedule: per-step linear warm-up, then half-cycle cosine (the MAE recipe)."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, base_lr: float, total_steps: int, warmup_steps: int, min_lr: float = 0.0) -> float:
    """The learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return base_lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr to `lr x lr_scale`; the scale carries e.g. layer-wise decay, so it
    holds whichever schedule drives the optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
