"""Images <-> flattened patches, in the official MAE (and transformers ViTMAE) order.

Patch order is row-major over the grid (h outer, w inner); inside a patch the pixels are
row-major with the channel last (`nchpwq -> nhwpqc`), so `pred` of any of the three
implementations lines up element for element.
"""

from __future__ import annotations

import torch


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """`imgs` [N, C, H, W] -> patches [N, L, p*p*C] with L = (H/p) * (W/p)."""
    n, c, h, w = imgs.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by the patch size {p}")
    gh, gw = h // p, w // p
    x = imgs.reshape(n, c, gh, p, gw, p)
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(n, gh * gw, p * p * c)


def unpatchify(x: torch.Tensor, patch_size: int, grid_size: tuple[int, int], in_chans: int = 3) -> torch.Tensor:
    """Patches [N, L, p*p*C] -> images [N, C, gh*p, gw*p]; the inverse of `patchify`."""
    n, length, _ = x.shape
    gh, gw = grid_size
    p = patch_size
    if gh * gw != length:
        raise ValueError(f"{length} patches do not fill a {gh}x{gw} grid")
    x = x.reshape(n, gh, gw, p, p, in_chans)
    x = torch.einsum("nhwpqc->nchpwq", x)
    return x.reshape(n, in_chans, gh * p, gw * p)
