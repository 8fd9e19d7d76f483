"""Probing parts: the paper's linear-probe head and a probe whose encoder stays frozen."""

from __future__ import annotations

import torch
from timm.models import group_parameters
from torch import nn


def probe_head(num_features: int, num_classes: int) -> nn.Sequential:
    """BatchNorm1d without affine (whitens the frozen features) then a linear layer, init std 0.01."""
    head = nn.Sequential(nn.BatchNorm1d(num_features, affine=False, eps=1e-6), nn.Linear(num_features, num_classes))
    nn.init.trunc_normal_(head[1].weight, std=0.01)
    nn.init.zeros_(head[1].bias)
    return head


def fold_probe_head(head: nn.Sequential) -> nn.Linear:
    """The head as one linear layer: the BatchNorm's running statistics folded into the weights."""
    bn, fc = head[0], head[1]
    scale = (bn.running_var + bn.eps).rsqrt()
    linear = nn.Linear(fc.in_features, fc.out_features)
    with torch.no_grad():
        linear.weight.copy_(fc.weight * scale)
        linear.bias.copy_(fc.bias - (fc.weight * scale) @ bn.running_mean)
    return linear


class LinearProbe(nn.Module):
    """`head(encoder(x))` with the encoder frozen: no gradients, and always in eval mode."""

    def __init__(self, encoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder.requires_grad_(False).eval()
        self.head = head

    def train(self, mode: bool = True) -> LinearProbe:
        super().train(mode)
        self.encoder.eval()  # dropout, drop-path and norms of the encoder never switch to training
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.encoder(x)
        return self.head(features.float())


def freeze_first_blocks(model: nn.Module, n: int) -> None:
    """Partial fine-tuning: the stem (patch embedding, prefix tokens, positions) and the first `n` blocks of a
    timm model stop training. Blocks as timm's `group_matcher` numbers them for layer-wise lr decay (0 the
    stem, i the i-th block), so any timm backbone with one is cut the same way; with the input of the first
    trained block needing no gradient, autograd skips the frozen layers' backward pass."""
    if n == 0:
        return
    layers = group_parameters(model, model.group_matcher(coarse=False))
    names = {name for layer, group in layers.items() if layer <= n for name in group}
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
