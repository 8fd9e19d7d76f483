"""Fixed 2-D sine-cosine position embeddings (MAE, after MoCo v3), for square and non-square grids."""

from __future__ import annotations

import torch


def sincos_1d(embed_dim: int, pos: torch.Tensor) -> torch.Tensor:
    """Positions [M] -> [M, embed_dim]: sin of the first half of the frequencies, then cos."""
    if embed_dim % 2:
        raise ValueError(f"a sine-cosine embedding needs an even width, got {embed_dim}")
    # float64 as the reference (NumPy) does, so the table matches it bit for bit once cast.
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega
    out = torch.outer(pos.reshape(-1).to(torch.float64), omega)  # the reference's einsum("m,d->md")
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_2d(embed_dim: int, grid_size: tuple[int, int], cls_token: bool = False) -> torch.Tensor:
    """The MAE table [(1 if cls_token) + gh*gw, embed_dim], float32; the cls row is zeros.

    Rows follow the patch order (row-major). As in the official code (`np.meshgrid(grid_w,
    grid_h)`), the first half of the channels encodes the column index and the second half the
    row index; keeping that order is what lets official and timm MAE weights load unchanged.
    """
    if embed_dim % 4:
        raise ValueError(f"a 2-D sine-cosine embedding needs a width divisible by 4, got {embed_dim}")
    gh, gw = grid_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    emb = torch.cat([sincos_1d(embed_dim // 2, cols), sincos_1d(embed_dim // 2, rows)], dim=1)
    if cls_token:
        emb = torch.cat([emb.new_zeros(1, embed_dim), emb], dim=0)
    return emb.float()
