import copy
import math

import pytest
import torch

from mae.models import masking
from mae.models.masking import gather_tokens, list_masks, mask_generator, num_visible, random_masking


def _reference(noise, mask_ratio):
    """The official/transformers random_masking, verbatim in its index logic."""
    n, length = noise.shape
    len_keep = int(length * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    mask = torch.ones([n, length])
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, dim=1, index=ids_restore)
    return ids_keep, ids_restore, mask


def test_matches_reference_semantics():
    noise = torch.rand(5, 49)
    for ratio in (0.0, 0.5, 0.75, 0.9):
        ours = random_masking(noise, ratio)
        ref = _reference(noise, ratio)
        for a, b in zip(ours, ref, strict=True):
            assert torch.equal(a, b)


def test_noise_determines_mask_and_smallest_are_kept():
    noise = torch.rand(3, 16)
    m = random_masking(noise, 0.75)
    assert m.ids_keep.shape == (3, num_visible(16, 0.75)) == (3, 4)
    assert torch.equal(m.mask.sum(1), torch.full((3,), 12.0))
    # the kept patches are exactly the 4 with the smallest noise
    smallest = noise.topk(4, dim=1, largest=False).indices.sort(1).values
    assert torch.equal(m.ids_keep.sort(1).values, smallest)
    assert torch.equal(m.mask.gather(1, m.ids_keep), torch.zeros(3, 4))
    assert torch.equal(random_masking(noise.clone(), 0.75).mask, m.mask)


def test_restore_undoes_shuffle():
    x = torch.randn(2, 10, 4)
    noise = torch.rand(2, 10)
    m = random_masking(noise, 0.0)
    shuffled = gather_tokens(x, m.ids_keep)
    assert torch.equal(gather_tokens(shuffled, m.ids_restore), x)


# --- mask generators ------------------------------------------------------------------------------

GRIDS = [(8, 8), (14, 14), (4, 6), (7, 4)]


def kept(name, grid, ratio=0.75, seed=0):
    """[gh, gw] bool: the patches a sample keeps under generator `name`."""
    length = grid[0] * grid[1]
    noise = mask_generator(name)(grid, num_visible(length, ratio), torch.Generator().manual_seed(seed))
    return (random_masking(noise[None], ratio).mask[0] == 0).view(grid)


def neighbours_alike(keep: torch.Tensor) -> float:
    """Fraction of horizontally or vertically adjacent patch pairs that are both kept or both masked."""
    same = [(keep[1:] == keep[:-1]).float().flatten(), (keep[:, 1:] == keep[:, :-1]).float().flatten()]
    return torch.cat(same).mean().item()


@pytest.mark.parametrize("name", list_masks())
@pytest.mark.parametrize("grid", GRIDS)
def test_every_generator_keeps_exactly_k_patches(name, grid):
    if name == "grid" and (grid[0] % 2 or grid[1] % 2):
        with pytest.raises(ValueError, match="even patch grid"):
            kept(name, grid)
        return
    for seed in range(20):
        assert int(kept(name, grid, seed=seed).sum()) == num_visible(grid[0] * grid[1], 0.75)


@pytest.mark.parametrize("name", list_masks())
def test_generators_depend_only_on_their_generator(name):
    assert torch.equal(kept(name, (8, 8), seed=3), kept(name, (8, 8), seed=3))
    assert any(not torch.equal(kept(name, (8, 8), seed=3), kept(name, (8, 8), seed=s)) for s in range(4, 10))


def test_grid_keeps_one_patch_of_each_2x2_cell():
    for seed in range(8):
        keep = kept("grid", (8, 6), seed=seed)
        cells = keep.view(4, 2, 3, 2).sum((1, 3))
        assert torch.equal(cells, torch.ones(4, 3, dtype=cells.dtype))
        ys, xs = keep.nonzero().T
        assert len(set((ys % 2).tolist())) == 1 and len(set((xs % 2).tolist())) == 1  # same place in every cell
    with pytest.raises(ValueError, match="mask ratio 0.75"):
        kept("grid", (8, 8), ratio=0.5)


def test_block_generators_lay_rectangles_where_random_scatters():
    """Blocks make neighbouring patches share their fate far more often than uniform masking does."""
    mean = {name: sum(neighbours_alike(kept(name, (14, 14), seed=s)) for s in range(20)) / 20 for name in list_masks()}
    assert mean["random"] < 0.7
    assert mean["block"] > mean["random"] + 0.1 and mean["inverse_block"] > mean["random"] + 0.1
    # inverse blocks keep rectangles: the kept patches touch each other; block's masked ones do.
    keep = kept("inverse_block", (14, 14), seed=0)
    assert ((keep[1:] & keep[:-1]).sum() + (keep[:, 1:] & keep[:, :-1]).sum()) > keep.sum()


def test_random_generator_is_the_models_uniform_noise():
    """`random` is the noise the pipeline always drew: torch.rand from the sample's generator."""
    g = torch.Generator().manual_seed(5)
    expected = torch.rand(64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(mask_generator("random")((8, 8), 16, g), expected)


# --- the block drawer (BEiT's blockwise masking), pinned rule by rule -----------------------------------
# `_blockwise` draws a rectangle's area and log-aspect through `_uniform`; scripting those two draws
# fixes the rectangle, so each rule below is checked exactly rather than as a tendency.


class Scripted:
    """Stands in for `masking._uniform`: answers every draw with (area, aspect) in turn and records the
    bounds each draw asked for."""

    def __init__(self, area: float, aspect: float):
        self.values, self.calls = [area, math.log(aspect)], []

    def __call__(self, generator, low, high):
        self.calls.append((low, high))
        return self.values[(len(self.calls) - 1) % 2]


def blocks(monkeypatch, grid, count, area, aspect, seed=0):
    script = Scripted(area, aspect)
    monkeypatch.setattr(masking, "_uniform", script)
    return masking._blockwise(grid, count, torch.Generator().manual_seed(seed)), script


def bounding_box(chosen: torch.Tensor) -> tuple[int, int, int, int]:
    ys, xs = chosen.nonzero().T
    return int(ys.min()), int(xs.min()), int(ys.max()) + 1 - int(ys.min()), int(xs.max()) + 1 - int(xs.min())


def connected(chosen: torch.Tensor) -> bool:
    """Whether the True patches form one 4-connected piece."""
    cells = {tuple(p) for p in chosen.nonzero().tolist()}
    seen, todo = set(), [next(iter(cells))]
    while todo:
        y, x = todo.pop()
        if (y, x) in seen:
            continue
        seen.add((y, x))
        todo += [q for q in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)) if q in cells]
    return seen == cells


def test_block_draws_area_from_4_to_what_is_missing_and_aspect_from_0_3_to_1_over_0_3(monkeypatch):
    _, script = blocks(monkeypatch, (8, 8), 4, area=4, aspect=1.0)
    assert script.calls == [(4, 4), (math.log(0.3), math.log(1 / 0.3))]  # one 2x2 square fills the count
    _, script = blocks(monkeypatch, (8, 8), 9, area=9, aspect=1.0)
    assert script.calls[0] == (4, 9)


@pytest.mark.parametrize(("area", "aspect", "shape"), [(6, 1.5, (3, 2)), (6, 1 / 1.5, (2, 3)), (4, 1.0, (2, 2))])
def test_a_block_of_area_a_and_aspect_r_is_sqrt_ar_tall_and_sqrt_a_over_r_wide(monkeypatch, area, aspect, shape):
    for seed in range(5):
        chosen, script = blocks(monkeypatch, (8, 8), shape[0] * shape[1], area, aspect, seed)
        top, left, h, w = bounding_box(chosen)
        assert (h, w) == shape and int(chosen.sum()) == h * w  # one solid rectangle
        assert len(script.calls) == 2  # and nothing more is drawn once the count is reached


def test_a_block_lands_anywhere_it_fits_with_equal_chance(monkeypatch):
    corners = {}
    for seed in range(300):
        chosen, _ = blocks(monkeypatch, (4, 5), 4, area=4, aspect=1.0, seed=seed)
        top, left, h, w = bounding_box(chosen)
        assert (h, w) == (2, 2) and int(chosen.sum()) == 4
        corners[top, left] = corners.get((top, left), 0) + 1
    assert set(corners) == {(t, s) for t in range(3) for s in range(4)}  # every placement, none outside
    assert max(corners.values()) < 3 * min(corners.values())


@pytest.mark.parametrize(("area", "aspect"), [(2, 0.5), (2, 2.0)])  # 1x2 and 2x1 dominoes
def test_a_block_that_overlaps_counts_only_what_it_adds(monkeypatch, area, aspect):
    """Three patches from dominoes: the second must add exactly the one missing patch, so it overlaps the
    first and the union is one piece (a fallback to uniform patches would scatter it)."""
    for seed in range(40):
        chosen, _ = blocks(monkeypatch, (5, 5), 3, area, aspect, seed)
        assert int(chosen.sum()) == 3 and connected(chosen)


def test_two_overlapping_squares_make_six_patches_in_one_rectangle(monkeypatch):
    for seed in range(40):
        chosen, _ = blocks(monkeypatch, (4, 4), 6, area=4, aspect=1.0, seed=seed)
        top, left, h, w = bounding_box(chosen)
        assert int(chosen.sum()) == 6 and sorted((h, w)) == [2, 3]


@pytest.mark.parametrize(("grid", "aspect"), [((2, 6), 1.0), ((6, 2), 1.0), ((1, 8), 1.0)])
def test_a_block_as_tall_or_wide_as_the_grid_is_never_laid_and_tries_stop_at_10_per_patch(monkeypatch, grid, aspect):
    spy = []
    real_randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: spy.append(a) or real_randperm(*a, **k))
    chosen, script = blocks(monkeypatch, grid, 4, area=4, aspect=aspect)  # a 2x2 square would fill the count
    assert len(script.calls) == 2 * 10 * grid[0] * grid[1]  # every try drew a 2x2 square that cannot fit
    assert int(chosen.sum()) == 4 and len(spy) == 1  # the rest is drawn uniformly, once


def test_no_uniform_fallback_once_blocks_reached_the_count(monkeypatch):
    spy = []
    real_randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: spy.append(a) or real_randperm(*a, **k))
    blocks(monkeypatch, (8, 8), 4, area=4, aspect=1.0)
    assert spy == []


@pytest.mark.parametrize("count", range(1, 8))
def test_where_no_block_fits_every_patch_is_drawn_uniformly_from_the_generator(count):
    """A 1x8 strip has no room for a block: the count comes from the uniform fallback, from the sample's
    generator only (the global RNG is reseeded in between and must not matter)."""
    hits = torch.zeros(8)
    for seed in range(60):
        torch.manual_seed(seed)
        a = masking._blockwise((1, 8), count, torch.Generator().manual_seed(seed))
        torch.manual_seed(seed + 1000)
        b = masking._blockwise((1, 8), count, torch.Generator().manual_seed(seed))
        assert torch.equal(a, b) and a.dtype == torch.bool and int(a.sum()) == count
        hits += a.float().flatten()
    assert bool((hits > 0).all())


@pytest.mark.parametrize("name", list_masks())
def test_generators_ignore_the_global_rng(name):
    torch.manual_seed(0)
    a = kept(name, (8, 8), seed=3)
    torch.manual_seed(1)
    b = kept(name, (8, 8), seed=3)
    torch.manual_seed(0)
    noise_a = mask_generator(name)((8, 8), 16, torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    noise_b = mask_generator(name)((8, 8), 16, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.equal(noise_a, noise_b)  # the order within kept/masked too


def test_uniform_draws_lie_between_their_bounds():
    g = torch.Generator().manual_seed(0)
    draws = [masking._uniform(g, 4.0, 10.0) for _ in range(500)]
    assert 4.0 <= min(draws) < 4.5 and 9.5 < max(draws) <= 10.0
    assert masking._uniform(g, 4.0, 4.0) == 4.0


def test_the_registry_hands_out_the_registered_functions_and_names_the_choices():
    assert mask_generator("random") is masking.random_mask and mask_generator("block") is masking.block_mask
    assert mask_generator("inverse_block") is masking.inverse_block_mask and mask_generator("grid") is masking.grid_mask
    choices = "block, grid, inverse_block, random"
    with pytest.raises(ValueError, match=rf"^unknown masking 'nope'; choose one of: {choices}$"):
        mask_generator("nope")


def test_a_mask_registered_by_a_plugin_is_handed_out_by_its_name(monkeypatch):
    monkeypatch.setattr(masking, "_MASKS", copy.deepcopy(masking._MASKS))  # the registry as it was, after the test

    @masking.register_mask("first_row")
    def first_row(grid, num_keep, generator):
        return torch.arange(grid[0] * grid[1], dtype=torch.float32)

    assert mask_generator("first_row") is first_row and "first_row" in list_masks()
    assert kept("first_row", (4, 4))[0].all() and int(kept("first_row", (4, 4)).sum()) == 4
