import pytest
import torch

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
    masking = random_masking(noise[None], ratio)
    return (masking.mask[0] == 0).view(grid)


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
