"""Classifiers over a pretrained encoder: the timm classifier built from an `EncoderSpec`, the paper's
linear-probe head, a probe whose encoder stays frozen, and partial fine-tuning."""

from __future__ import annotations

import warnings
from typing import Any

import timm
import torch
from timm.models import group_parameters
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import nn

from mae.errors import CheckpointError, ConfigError
from mae.models.encoder import EncoderSpec


def build_classifier(
    spec: EncoderSpec,
    num_classes: int,
    *,
    img_size: int | tuple[int, int] | None = None,
    global_pool: str = "token",
    fc_norm: bool | None = None,
    drop_path_rate: float = 0.0,
) -> tuple[VisionTransformer, str, dict[str, Any]]:
    """A timm model with the encoder's weights and a fresh head; returns (model, arch, model args).

    With average pooling and `fc_norm` (timm's default for "avg", the paper's fine-tuning), the
    encoder's final norm is dropped and `fc_norm` starts fresh, as the official code does.
    A different `img_size` resamples the position embedding (timm's checkpoint filter). The head,
    `fc_norm`, `global_pool` and the checkpoint filter are timm ViT's (no adapter method covers them).
    """
    if global_pool == "token" and not spec.has_class_token:
        warnings.warn(f"{spec.arch} has no class token: pooling the patch tokens' average instead", stacklevel=2)
        global_pool = "avg"
    args = {**spec.args, "global_pool": global_pool, "drop_path_rate": drop_path_rate}
    if fc_norm is not None:
        args["fc_norm"] = fc_norm
    if img_size is not None:
        args["img_size"] = [img_size, img_size] if isinstance(img_size, int) else list(img_size)
    model = timm.create_model(spec.arch, pretrained=False, num_classes=num_classes, **args)
    state = checkpoint_filter_fn(dict(spec.state), model)
    for name in ("norm", "fc_norm"):  # norms this classifier does not have
        if isinstance(getattr(model, name), nn.Identity):
            state = {k: v for k, v in state.items() if not k.startswith(f"{name}.")}
    result = model.load_state_dict(state, strict=False)
    # Fresh: the head, fc_norm, and the final norm of an encoder that had none (timm's "gap" ViTs).
    new = ("head.", "fc_norm.") + (("norm.",) if "norm.weight" not in spec.state else ())
    fresh = [k for k in result.missing_keys if not k.startswith(new)]
    if fresh or result.unexpected_keys:
        raise CheckpointError(
            f"the encoder does not fit {spec.arch}: missing {fresh}, unexpected {result.unexpected_keys}"
        )
    if num_classes:
        nn.init.zeros_(model.head.bias)
    args = {k: v for k, v in args.items() if k != "drop_path_rate"}
    return model, spec.arch, args


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
    trained block needing no gradient, autograd skips the frozen layers' backward pass. `n` beyond the depth is
    the --model.frozen_blocks error every stage that takes the option gives."""
    if n > len(model.blocks):
        raise ConfigError(f"--model.frozen_blocks {n}: the encoder has {len(model.blocks)} blocks; choose 0 to "
                          f"{len(model.blocks)}")  # fmt: skip
    if n == 0:
        return
    layers = group_parameters(model, model.group_matcher(coarse=False))
    names = {name for layer, group in layers.items() if layer <= n for name in group}
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
