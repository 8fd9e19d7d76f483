"""Per-sample random masking by argsort of noise (official MAE / transformers ViTMAE semantics)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Masking(NamedTuple):
    """Which patches a sample keeps.

    ids_keep:    [N, K]  indices (into the L patches) of the visible patches, in shuffled order.
    ids_restore: [N, L]  where each original patch sits in `cat([visible, masked])`; gathering
                         with it undoes the shuffle.
    mask:        [N, L]  1 = masked (removed), 0 = visible, in the original patch order.
    """

    ids_keep: torch.Tensor
    ids_restore: torch.Tensor
    mask: torch.Tensor


def num_visible(num_patches: int, mask_ratio: float) -> int:
    """How many patches stay visible: `int(L * (1 - mask_ratio))`, as the reference computes it."""
    return int(num_patches * (1 - mask_ratio))


def random_masking(noise: torch.Tensor, mask_ratio: float) -> Masking:
    """Rank the patches of each sample by ascending `noise` [N, L]; keep the first K."""
    n, length = noise.shape
    len_keep = num_visible(length, mask_ratio)
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small is keep, large is remove
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    # The mask is 1 exactly where ids_restore points past the visible block.
    mask = (ids_restore >= len_keep).float()
    return Masking(ids_keep, ids_restore, mask)


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Select tokens per sample: `x` [N, L, D], `ids` [N, K] -> [N, K, D]."""
    return torch.gather(x, 1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
