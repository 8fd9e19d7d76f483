import pytest
import torch

from mae.models.patches import patchify, unpatchify


@pytest.mark.parametrize("shape,p", [((2, 3, 32, 32), 8), ((2, 3, 32, 48), 8), ((1, 1, 28, 14), 7)])
def test_unpatchify_inverts_patchify(shape, p):
    x = torch.randn(shape)
    patches = patchify(x, p)
    grid = (shape[2] // p, shape[3] // p)
    assert patches.shape == (shape[0], grid[0] * grid[1], p * p * shape[1])
    assert torch.equal(unpatchify(patches, p, grid, shape[1]), x)


def test_patch_order_is_row_major_channel_last():
    # The official layout: patch index = row * gw + col; inside a patch (py, px, c).
    x = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(1, 2, 4, 6)
    patches = patchify(x, 2)
    row, col, py, px, c = 1, 2, 1, 0, 1
    assert patches[0, row * 3 + col, (py * 2 + px) * 2 + c] == x[0, c, row * 2 + py, col * 2 + px]


def test_patchify_rejects_indivisible_size():
    with pytest.raises(ValueError, match="not divisible"):
        patchify(torch.zeros(1, 3, 30, 32), 8)


def test_unpatchify_reads_rgb_by_default_and_names_a_grid_that_does_not_fit():
    x = torch.randn(2, 3, 16, 24)
    assert torch.equal(unpatchify(patchify(x, 8), 8, (2, 3)), x)  # in_chans defaults to RGB's 3
    with pytest.raises(ValueError, match=r"^6 patches do not fill a 3x3 grid$"):
        unpatchify(patchify(x, 8), 8, (3, 3))
