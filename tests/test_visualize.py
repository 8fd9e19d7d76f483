import numpy as np
import pytest
import torch
from PIL import Image
from timm.models.vision_transformer import VisionTransformer

from mae.config import ConfigError
from mae.data.images import read_rgb
from mae.figures import attention_grid, cls_attention, reconstruction_grid
from mae.stages.visualize import _read_images


def test_cls_attention_is_the_last_blocks_softmax():
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=0).eval()
    x = torch.randn(2, 3, 32, 32)
    captured = {}
    last = vit.blocks[-1].attn
    last.fused_attn = False  # timm's explicit path passes the weights through attn_drop
    last.attn_drop.register_forward_hook(lambda m, i, o: captured.setdefault("w", o))
    vit.forward_features(x)
    maps = cls_attention(vit, x)
    assert maps.shape == (2, 3, 4, 4)
    torch.testing.assert_close(maps.flatten(2), captured["w"][:, :, 0, 1:])
    assert torch.all(maps.flatten(2).sum(-1) <= 1.0 + 1e-6)


def test_attention_and_reconstruction_grids_have_the_documented_layout():
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3, num_classes=0)
    imgs = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
    grid = attention_grid(vit, imgs, (0.5,) * 3, (0.25,) * 3)
    side = 4 * 32  # small images are drawn 4x (nearest): at least 128 px
    assert grid.shape == (3, 2 * (side + 2) + 2, 5 * (side + 2) + 2)  # image, mean, 3 heads; 2 rows; 2 px padding
    assert 0 <= grid.min() and grid.max() <= 1

    from mae.data.transforms import normalize
    from mae.models import create_mae

    model = create_mae("mae_vit_micro_patch8").eval()
    noise = torch.rand(2, 16)
    grid, loss = reconstruction_grid(model, imgs, noise, (0.5,) * 3, (0.25,) * 3)
    out = model(normalize(imgs, (0.5,) * 3, (0.25,) * 3), noise=noise)
    assert grid.shape == (3, 2 * (side + 2) + 2, 4 * (side + 2) + 2) and loss == pytest.approx(out.loss.item())
    mask = out.mask[0].reshape(4, 4)

    def cell(col, r, c):  # patch (r, c) of image 0 in grid column `col`: 8 px drawn as 32
        y, x = 2 + 32 * r, 2 + (side + 2) * col + 32 * c
        return grid[:, y : y + 32, x : x + 32]

    original = imgs[0].float() / 255
    for r in range(4):
        for c in range(4):
            patch = original[:, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8]
            assert torch.allclose(cell(0, r, c), patch.repeat_interleave(4, 1).repeat_interleave(4, 2), atol=1e-6)
            if mask[r, c] == 0:  # visible: column 3 pastes the original back
                assert torch.equal(cell(3, r, c), cell(0, r, c))
            else:  # masked: grey in column 1, the reconstruction in column 3
                assert torch.allclose(cell(1, r, c), torch.full_like(cell(1, r, c), 0.5))
                assert torch.equal(cell(3, r, c), cell(2, r, c))


def test_small_images_are_enlarged_to_at_least_128_px_and_large_ones_kept():
    from mae.figures import enlarge

    small = torch.rand(2, 1, 28, 28)
    big = enlarge(small)
    assert big.shape == (2, 1, 140, 140)  # 5x: the smallest whole factor reaching 128
    assert torch.equal(big[:, :, ::5, ::5], small) and torch.equal(big[:, :, 4::5, 4::5], small)  # nearest
    assert enlarge(torch.rand(1, 3, 96, 200)).shape == (1, 3, 192, 400)  # the shorter side decides
    large = torch.rand(1, 3, 128, 160)
    assert enlarge(large) is large


def test_visualize_reads_its_images_as_training_does(tmp_path):
    """--images takes what a training folder holds (an RGB `.npy`, an LZW TIFF) and folders (their first 8
    images in name order); an empty folder is a one-line error."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(
            folder / f"{i:02d}.tif", compression="tiff_lzw"
        )
    np.save(tmp_path / "rgb.npy", rng.random((20, 20, 3)).astype(np.float32))
    x = _read_images([str(tmp_path / "rgb.npy"), str(folder)], (20, 20))
    expected = [read_rgb(str(tmp_path / "rgb.npy"))] + [read_rgb(str(folder / f"{i:02d}.tif")) for i in range(8)]
    assert x.shape == (9, 3, 20, 20)
    assert all(np.array_equal(x[i].permute(1, 2, 0).numpy(), np.asarray(img)) for i, img in enumerate(expected))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: a folder without images"):
        _read_images([str(tmp_path / "empty")], (20, 20))


def test_reconstructions_of_an_encoder_only_file_say_a_trained_decoder_is_needed(tmp_path, capsys):
    """`mae visualize` of an encoder export stops with one line (a fresh decoder's reconstructions are noise); the
    attention maps, which read the encoder alone, are drawn from it."""
    import mae
    from mae.cli import main

    encoder = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "encoder.safetensors")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    images = ["--images", str(tmp_path / "a.png")]
    assert main(["visualize", "--checkpoint", str(encoder), *images, "--output", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an encoder only, and reconstructions need its trained decoder" in err[0], err
    assert not (tmp_path / "r.png").exists()
    attention = ["visualize", "--attention", "--pretrained", str(encoder), *images, "--output", str(tmp_path / "a.png")]
    assert main(attention) == 0 and (tmp_path / "a.png").is_file()
