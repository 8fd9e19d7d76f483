"""A plug-in's three registrations at once, through the public functions only: a mask generator, a decoder and a
data-source kind, all used by one `mae.pretrain(...)` call, then unregistered, after which the same call is
refused by name."""

import json
import zipfile

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from torch import nn

import mae
from mae.data.open import list_sources, register_source, unregister_source
from mae.models import list_decoders, register_decoder, unregister_decoder
from mae.models.masking import list_masks, register_mask, unregister_mask
from tests.conftest import make_images
from tests.data.test_open import ZipKind

CALLS: list[tuple[tuple[int, int], int]] = []  # (grid, patches kept) of every call of the mask generator


def first_patches(grid: tuple[int, int], num_keep: int, generator: torch.Generator) -> torch.Tensor:
    """Keeps the first `num_keep` patches in raster order, whatever the generator."""
    CALLS.append((tuple(grid), num_keep))
    return torch.arange(grid[0] * grid[1], dtype=torch.float32)


class TokenwiseDecoder(nn.Module):
    """Visible tokens and a mask token, unshuffled, each mapped to pixels by one linear layer."""

    def __init__(self, *, grid_size, patch_size, in_chans, embed_dim, num_prefix_tokens, **_):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pred = nn.Linear(embed_dim, patch_size**2 * in_chans)

    def forward(self, latent, ids_restore):
        """`latent` [N, P + K, D], `ids_restore` [N, L] -> (pred [N, L, p*p*C], predicted [N, L]: all ones)."""
        x = latent[:, self.num_prefix_tokens :]
        n, length = ids_restore.shape
        x = torch.cat([x, self.mask_token.expand(n, length - x.shape[1], -1)], dim=1)
        x = torch.gather(x, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return self.pred(x), torch.ones(n, length, device=x.device)


@pytest.fixture
def registered():
    """The three registrations a plug-in module makes on import; undone after the test, as a test must."""
    register_mask("first_patches")(first_patches)
    register_decoder("tokenwise")(TokenwiseDecoder)
    register_source(ZipKind)
    CALLS.clear()
    yield
    unregister_mask("first_patches")
    unregister_decoder("tokenwise")
    unregister_source("zip")


def pretrain(zipped, out):
    AcceleratorState._reset_state(True)
    return mae.pretrain(
        data={"path": str(zipped), "num_workers": 0},
        model={"name": "mae_vit_micro_patch8", "img_size": 32, "decoder": "tokenwise", "masking": "first_patches"},
        loop={"epochs": 1, "batch_size": 4, "progress": False, "mixed_precision": "no"},
        optim={"warmup_epochs": 0},
        output_dir=str(out),
    )


@pytest.mark.slow
def test_a_plugins_mask_decoder_and_source_train_together_then_go(registered, tmp_path):
    make_images(tmp_path / "imgs", n=8, nested=False)
    zipped = tmp_path / "photos.zip"
    with zipfile.ZipFile(zipped, "w") as zf:
        for f in sorted((tmp_path / "imgs").iterdir()):
            zf.write(f, f.name)
    result = pretrain(zipped, tmp_path / "pre")
    logged = [json.loads(x) for x in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "img_per_s" in r]
    assert steps[-1]["step"] == 2 and steps[-1]["skipped_files"] == 0  # 8 images of the zip, 4 a batch
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in steps])))
    # the generator drew every training sample's mask (and the stage's check of it): a 4x4 grid, 4 kept
    assert len(CALLS) >= 8 + 1 and set(CALLS) == {((4, 4), 4)}, CALLS[:3]
    trained = mae.load_pretrained(result.output_dir)
    assert trained.decoder_name == "tokenwise" and isinstance(trained.decoder, TokenwiseDecoder)
    assert yaml.safe_load((tmp_path / "pre" / "config.yaml").read_text())["model"]["masking"] == "first_patches"

    unregister_mask("first_patches")
    assert "first_patches" not in list_masks()
    with pytest.raises(mae.MaeError, match="unknown masking 'first_patches'; choose one of: block, grid"):
        pretrain(zipped, tmp_path / "no_mask")
    register_mask("first_patches")(first_patches)
    unregister_decoder("tokenwise")
    assert "tokenwise" not in list_decoders()
    with pytest.raises(mae.MaeError, match="unknown decoder 'tokenwise'; choose one of: cross, mae"):
        pretrain(zipped, tmp_path / "no_decoder")
    register_decoder("tokenwise")(TokenwiseDecoder)
    unregister_source("zip")
    assert "zip" not in list_sources()
    with pytest.raises(mae.MaeError, match="expected a folder"):
        pretrain(zipped, tmp_path / "no_source")
