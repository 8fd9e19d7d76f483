"""Masking: per-sample noise ranks the patches (official MAE / transformers ViTMAE semantics), and the
mask generators that draw that noise (random, block, inverse_block, grid), one registry line each."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from mae.registry import Registry


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


# --- mask generators: which patches a sample keeps, drawn in the data pipeline -------------------------
#
# A generator maps (grid size, number of patches to keep K, a torch.Generator) to `noise` [L] in which
# the K patches to keep rank first (ascending). `random_masking` turns that noise into the masking, so
# the model never knows which strategy ran, every sample keeps exactly K patches (the encoder batch
# stays dense), and the masks are reproducible from the generator's seed alone.
MaskGenerator = Callable[[tuple[int, int], int, torch.Generator], torch.Tensor]
_MASKS: Registry[MaskGenerator] = Registry("masking")


def register_mask(name: str) -> Callable[[MaskGenerator], MaskGenerator]:
    """Decorator: make a mask generator available as `--model.masking NAME`."""

    def add(fn: MaskGenerator) -> MaskGenerator:
        return _MASKS.register(name, fn)

    return add


def unregister_mask(name: str) -> None:
    """Forget the generator registered as `name` (a plug-in's tests register their own and remove them after)."""
    _MASKS.unregister(name)


def list_masks() -> list[str]:
    return sorted(_MASKS.names())


def mask_generator(name: str) -> MaskGenerator:
    """The generator registered as `name`; ConfigError (a ValueError) naming the choices otherwise."""
    return _MASKS.get(name)


def _ranked_first(keep: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Noise [L] putting the patches where `keep` [gh, gw] is True first, in random order within each part."""
    return torch.rand(keep.numel(), generator=generator) + (~keep.flatten()).float()


def _uniform(generator: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * torch.rand((), generator=generator).item()


def _blockwise(grid: tuple[int, int], count: int, generator: torch.Generator) -> torch.Tensor:
    """Exactly `count` True patches [gh, gw] laid as random rectangles (BEiT's blockwise masking: area
    >= 4 patches, aspect ratio in [0.3, 1/0.3], a rectangle added only if it adds at most what is still
    missing); patches still missing after 10 tries per patch are drawn uniformly."""
    gh, gw = grid
    chosen = torch.zeros(gh, gw, dtype=torch.bool)
    for _ in range(10 * gh * gw):
        missing = count - int(chosen.sum())
        if missing <= 0:
            break
        area = _uniform(generator, 4, max(4, missing))
        aspect = math.exp(_uniform(generator, math.log(0.3), math.log(1 / 0.3)))
        h, w = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < h < gh and 0 < w < gw:
            top = int(torch.randint(0, gh - h + 1, (), generator=generator))
            left = int(torch.randint(0, gw - w + 1, (), generator=generator))
            added = h * w - int(chosen[top : top + h, left : left + w].sum())
            if 0 < added <= missing:
                chosen[top : top + h, left : left + w] = True
    missing = count - int(chosen.sum())
    if missing > 0:
        free = (~chosen).flatten().nonzero().squeeze(1)
        pick = free[torch.randperm(len(free), generator=generator)[:missing]]
        chosen.view(-1)[pick] = True
    return chosen


@register_mask("random")
def random_mask(grid: tuple[int, int], num_keep: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform per-sample masking (the paper's default): i.i.d. uniform noise."""
    return torch.rand(grid[0] * grid[1], generator=generator)


@register_mask("block")
def block_mask(grid: tuple[int, int], num_keep: int, generator: torch.Generator) -> torch.Tensor:
    """BEiT-style blockwise masking: the removed patches form rectangles."""
    masked = _blockwise(grid, grid[0] * grid[1] - num_keep, generator)  # [gh, gw] bool, exactly L - K True
    return _ranked_first(~masked, generator)  # noise [L]: the kept patches rank first


@register_mask("inverse_block")
def inverse_block_mask(grid: tuple[int, int], num_keep: int, generator: torch.Generator) -> torch.Tensor:
    """data2vec 2.0's inverse blocks: the kept patches form rectangles, everything else is removed."""
    return _ranked_first(_blockwise(grid, num_keep, generator), generator)


@register_mask("grid")
def grid_mask(grid: tuple[int, int], num_keep: int, generator: torch.Generator) -> torch.Tensor:
    """Keep one patch of each 2x2 cell (the paper's grid-wise sampling), at the same place in every cell
    (drawn per sample). Needs an even grid and mask ratio 0.75."""
    gh, gw = grid
    if gh % 2 or gw % 2 or num_keep != gh * gw // 4:
        raise ValueError(
            f"grid masking keeps one patch of each 2x2 cell: it needs an even patch grid (got {gh}x{gw}) and "
            f"mask ratio 0.75 ({gh * gw // 4} of {gh * gw} patches kept, not {num_keep})"
        )
    dy, dx = (int(v) for v in torch.randint(0, 2, (2,), generator=generator))
    keep = torch.zeros(gh, gw, dtype=torch.bool)
    keep[dy::2, dx::2] = True
    return _ranked_first(keep, generator)
