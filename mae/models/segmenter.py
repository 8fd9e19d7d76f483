"""Semantic segmentation from a ViT's patch tokens: `Segmenter` = a timm ViT encoder + a head (a small registry,
`register_head`) that turns the token grid into per-pixel logits, and the sliding-window inference that takes
images of any size.

Heads built in:
- `linear`: BatchNorm + 1x1 convolution on the tokens, bilinear upsampling; the encoder stays frozen (DINOv2's
  linear segmentation evaluation: the probe of dense features).
- `progressive`: SETR-PUP (Zheng et al. 2021): conv + norm + ReLU, then one 2x upsampling stage (conv + norm + ReLU)
  per factor 2 of the patch size; the encoder is fine-tuned with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mae.registry import Registry


@dataclass(frozen=True)
class HeadKind:
    """A registered head: `build(embed_dim, num_classes, patch_size)` -> a module whose
    `forward(tokens [N, D, gh, gw], size (H, W))` gives logits [N, K, H, W]; `trains_encoder` False keeps the
    encoder frozen (a probe)."""

    build: Callable[[int, int, int], nn.Module]
    trains_encoder: bool
    description: str


HEADS: Registry[HeadKind] = Registry("segmentation head")


def register_head(name: str, *, trains_encoder: bool, description: str = "") -> Callable:
    """Decorator: make `build(embed_dim, num_classes, patch_size)` the head `name` (`mae segment --head name`)."""

    def add(build: Callable[[int, int, int], nn.Module]) -> Callable[[int, int, int], nn.Module]:
        HEADS.register(name, HeadKind(build, trains_encoder, description))
        return build

    return add


def list_heads() -> list[str]:
    return HEADS.names()


class LinearHead(nn.Module):
    """BatchNorm2d + 1x1 conv on the token grid, bilinear upsampling to the image."""

    def __init__(self, embed_dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(embed_dim)
        self.classifier = nn.Conv2d(embed_dim, num_classes, 1)
        nn.init.trunc_normal_(self.classifier.weight, std=0.01)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, tokens: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        logits = self.classifier(self.norm(tokens))
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class ProgressiveHead(nn.Module):
    """SETR-PUP, sized for the CPU: a conv block on the tokens, then 2x bilinear upsampling + conv block stages up to
    half the image's resolution, each halving the channels (not below 32), a 1x1 classifier and a last bilinear
    resize to the image (the convolutions at full resolution would cost several times the encoder)."""

    def __init__(self, embed_dim: int, num_classes: int, patch_size: int, channels: int = 128) -> None:
        super().__init__()
        stages = max(1, round(math.log2(patch_size)) - 1)
        widths = [max(32, channels >> i) for i in range(stages + 1)]
        self.stem = _conv_block(embed_dim, widths[0])
        self.ups = nn.ModuleList(_conv_block(widths[i], widths[i + 1]) for i in range(stages))
        self.classifier = nn.Conv2d(widths[-1], num_classes, 1)

    def forward(self, tokens: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        x = self.stem(tokens)
        for up in self.ups:
            x = up(F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False))
        logits = self.classifier(x)
        if tuple(logits.shape[-2:]) != tuple(size):
            logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        return logits


@register_head("linear", trains_encoder=False, description="BatchNorm + 1x1 conv, frozen encoder (the probe)")
def linear_head(embed_dim: int, num_classes: int, patch_size: int) -> nn.Module:
    return LinearHead(embed_dim, num_classes)


@register_head("progressive", trains_encoder=True, description="SETR-PUP decoder, encoder fine-tuned")
def progressive_head(embed_dim: int, num_classes: int, patch_size: int) -> nn.Module:
    return ProgressiveHead(embed_dim, num_classes, patch_size)


class Segmenter(nn.Module):
    """`head(patch tokens as a grid)`: per-pixel logits [N, K, H, W] of images [N, C, H, W] at the encoder's input
    size (`forward`), or of any size (`segment`). Prefix tokens (class, registers) are dropped. With
    `frozen_encoder`, the encoder gets no gradient and stays in eval mode."""

    def __init__(self, encoder: nn.Module, head: nn.Module, *, frozen_encoder: bool) -> None:
        super().__init__()
        self.encoder, self.head, self.frozen_encoder = encoder, head, frozen_encoder
        if frozen_encoder:
            self.encoder.requires_grad_(False).eval()
        patch = encoder.patch_embed.patch_size
        self.patch_size = (patch, patch) if isinstance(patch, int) else tuple(patch)
        self.img_size = tuple(encoder.patch_embed.img_size)

    def train(self, mode: bool = True) -> Segmenter:
        super().train(mode)
        if self.frozen_encoder:
            self.encoder.eval()  # its norms and drop path never switch to training
        return self

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> the patch tokens as a grid [N, D, H / p, W / p]."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen_encoder):
            tokens = self.encoder.forward_features(x)
        tokens = tokens[:, getattr(self.encoder, "num_prefix_tokens", 1) :]
        gh, gw = x.shape[-2] // self.patch_size[0], x.shape[-1] // self.patch_size[1]
        return tokens.transpose(1, 2).reshape(-1, tokens.shape[-1], gh, gw)  # batch free (an ONNX export's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] at the input size -> logits [N, K, H, W]."""
        return self.head(self.forward_features(x).float(), tuple(x.shape[-2:]))

    @torch.no_grad()
    def segment(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, K, H, W] of normalised images [N, C, H, W] of any size (`sliding_window`)."""
        return sliding_window(self, x, self.img_size)

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's ViT grouping (stem 0, block i, the final norm last) under `encoder.`; the head, matched by none,
        falls in the last group (layer-wise lr decay: full lr)."""
        inner = self.encoder.group_matcher(coarse)

        def prefixed(rule):
            if isinstance(rule, str):
                return r"^encoder\.(?:" + rule.lstrip("^") + ")"
            return [(r"^encoder\.(?:" + pattern.lstrip("^") + ")", order) for pattern, order in rule]

        return {k: prefixed(v) for k, v in inner.items()}

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{name}" for name in self.encoder.no_weight_decay()}


def window_starts(length: int, window: int) -> list[int]:
    """Where windows of `window` start along an axis of `length` (>= window), a third overlapping, the last
    flush with the end."""
    stride = max(1, window * 2 // 3)
    starts = list(range(0, length - window + 1, stride))
    if starts[-1] != length - window:
        starts.append(length - window)
    return starts


def sliding_window(model: nn.Module, x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """Logits [N, K, H, W] of images [N, C, H, W] of any size: the images rescaled to just cover the model's input
    `window` (as the training crops were drawn around that scale), a window slid over them with a third of
    overlap, the overlapping logits averaged, the result resized back to (H, W). An image of the input size is one
    window."""
    (h, w), (height, width) = window, x.shape[-2:]
    factor = max(h / height, w / width)
    rh, rw = max(h, round(height * factor)), max(w, round(width * factor))
    scaled = x if (rh, rw) == (height, width) else F.interpolate(x, size=(rh, rw), mode="bilinear",
                                                                 align_corners=False, antialias=True)  # fmt: skip
    total, count = None, torch.zeros(1, 1, rh, rw, device=x.device)
    for top in window_starts(rh, h):
        for left in window_starts(rw, w):
            logits = model(scaled[:, :, top : top + h, left : left + w]).float()
            if total is None:
                total = torch.zeros(len(x), logits.shape[1], rh, rw, device=x.device)
            total[:, :, top : top + h, left : left + w] += logits
            count[:, :, top : top + h, left : left + w] += 1
    logits = total / count
    if (rh, rw) != (height, width):
        logits = F.interpolate(logits, size=(height, width), mode="bilinear", align_corners=False)
    return logits
