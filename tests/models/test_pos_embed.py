import math

import numpy as np
import pytest
import torch

from mae.models import create_mae
from mae.models.pos_embed import sincos_1d, sincos_2d


def _official_table(embed_dim, grid_size):
    """The official NumPy code (models/pos_embed.py of facebookresearch/mae); an int is a square grid, as there,
    an (h, w) pair the same code with the two sizes apart."""
    gh, gw = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_h = np.arange(gh, dtype=np.float32)
    grid_w = np.arange(gw, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, gh, gw])
    emb = np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)
    return np.concatenate([np.zeros([1, embed_dim]), emb], axis=0)


@pytest.mark.parametrize("dim,grid", [(64, 4), (768, 14)])
def test_table_matches_official(dim, grid):
    ours = sincos_2d(dim, (grid, grid), cls_token=True)
    ref = torch.from_numpy(_official_table(dim, grid)).float()
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dim,grid", [(32, (2, 5)), (192, (7, 3))])
def test_non_square_table_is_the_official_code_with_both_sizes(dim, grid):
    assert torch.equal(sincos_2d(dim, grid, cls_token=True), torch.from_numpy(_official_table(dim, grid)).float())
    without = sincos_2d(dim, grid)
    assert without.dtype == torch.float32 and torch.equal(without, sincos_2d(dim, grid, cls_token=True)[1:])


def test_widths_that_cannot_hold_the_table_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^a sine-cosine embedding needs an even width, got 7$"):
        sincos_1d(7, torch.arange(3))
    with pytest.raises(ValueError, match=r"^a 2-D sine-cosine embedding needs a width divisible by 4, got 18$"):
        sincos_2d(18, (2, 2))
    assert sincos_1d(6, torch.arange(3)).shape == (3, 6)


def test_non_square_table_encodes_column_then_row():
    dim, (gh, gw) = 16, (2, 3)
    table = sincos_2d(dim, (gh, gw))
    for r in range(gh):
        for c in range(gw):
            row = table[r * gw + c]
            # first quarter: sin(col * omega_0 ...), omega_0 = 1 -> sin(col); third quarter: sin(row)
            assert math.isclose(row[0].item(), math.sin(c), abs_tol=1e-6)
            assert math.isclose(row[dim // 2].item(), math.sin(r), abs_tol=1e-6)


@pytest.mark.parametrize("img_size", [32, (32, 48)])
def test_model_tables_are_fixed_sincos(img_size):
    model = create_mae("mae_vit_micro_patch8", img_size=img_size)
    grid = model.grid_size
    enc, dec = model.encoder.pos_embed, model.decoder.pos_embed
    assert torch.equal(enc[0], sincos_2d(enc.shape[-1], grid, cls_token=True))
    assert torch.equal(dec[0], sincos_2d(dec.shape[-1], grid, cls_token=True))
    assert torch.count_nonzero(enc[0, 0]) == 0 and enc[0, 1:].abs().sum() > 0
    assert not enc.requires_grad and not dec.requires_grad
    # Not trained: a step of the optimiser leaves them untouched.
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = enc.detach().clone(), dec.detach().clone()
    model(torch.randn(2, 3, *model.img_size)).loss.backward()
    opt.step()
    assert torch.equal(enc, before[0]) and torch.equal(dec, before[1])
