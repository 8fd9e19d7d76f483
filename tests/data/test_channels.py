"""Any image: grayscale, 16-bit and multispectral files, read at their precision and channel count."""

import json
import re

import numpy as np
import pytest
import tifffile
import timm
import torch
import yaml
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import mae
from mae.cli import main
from mae.data.folder import FolderSource
from mae.data.images import read_array
from mae.data.transforms import PretrainSamples
from mae.errors import ChannelError
from mae.weights.record import read_spec

H, W = 64, 96


def smooth(rng, channels):
    """[H, W, C] smooth random data in [0, 1] (learnable, unlike white noise)."""
    coarse = torch.from_numpy(rng.random((1, channels, 4, 6)))
    return torch.nn.functional.interpolate(coarse, size=(H, W), mode="bicubic").clamp(0, 1)[0].permute(1, 2, 0).numpy()


def write_folder(root, channels, n=16, kind="npy", seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        a = smooth(rng, channels)
        if kind == "npy":
            np.save(root / f"{i:03d}.npy", a.astype(np.float32))
        elif kind == "tif":
            tifffile.imwrite(root / f"{i:03d}.tif", (a * 65535).astype(np.uint16), photometric="minisblack")
        else:  # 16-bit grayscale PNG
            Image.fromarray((a[..., 0] * 65535).astype(np.uint16)).save(root / f"{i:03d}.png")
    return root


def test_sixteen_bit_precision_is_kept(tmp_path):
    base = np.full((8, 8), 200 * 256, dtype=np.uint16)
    Image.fromarray(base).save(tmp_path / "a.png")
    Image.fromarray(base + 7).save(tmp_path / "b.png")  # differs only below 8 bits
    a, b = read_array(str(tmp_path / "a.png")), read_array(str(tmp_path / "b.png"))
    assert a.shape == (8, 8, 1) and a.dtype == np.float32
    assert not np.array_equal(a, b) and np.allclose(b - a, 7 / 65535)
    source = FolderSource(tmp_path)
    samples = PretrainSamples(source, img_size=(8, 8), patch_size=4, seed=0, crop_scale=(1, 1), hflip=False,
                              in_chans=1)  # fmt: skip
    x, y = samples[(0, 0)]["image"], samples[(0, 1)]["image"]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and not torch.equal(x, y)


def test_multiband_tiff_and_npy_read_with_every_band(tmp_path):
    rng = np.random.default_rng(0)
    a = smooth(rng, 13)
    tifffile.imwrite(tmp_path / "planar.tif", (np.moveaxis(a, -1, 0) * 65535).astype(np.uint16))
    np.save(tmp_path / "bands.npy", a)
    assert read_array(str(tmp_path / "planar.tif")).shape == (H, W, 13)
    np.testing.assert_allclose(read_array(str(tmp_path / "bands.npy")), a, atol=1e-6)


def test_a_four_band_file_in_a_three_band_run_is_an_error(tmp_path, capsys):
    write_folder(tmp_path / "imgs", 4, n=4, kind="tif")
    AcceleratorState._reset_state(True)
    code = main(["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--data.path",
                 str(tmp_path / "imgs"), "--loop.batch_size", "2", "--loop.progress", "false",
                 "--output_dir", str(tmp_path / "o")])  # fmt: skip
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("mae pretrain")]
    assert code == 2 and len(err) == 1 and "000.tif: 4 channel(s), but --model.in_chans is 3" in err[0], err
    with pytest.raises(ChannelError):
        FolderSource(tmp_path / "imgs").load(0)


@pytest.mark.parametrize("channels,kind", [(1, "png"), (13, "npy")])
def test_pretrain_resume_export_with_any_channel_count(tmp_path, channels, kind):
    data = write_folder(tmp_path / "imgs", channels, kind=kind)
    out = tmp_path / "run"
    args = ["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", f"[{H}, {W}]",
            "--model.in_chans", str(channels), "--data.path", str(data),
            "--loop.batch_size", "4", "--data.num_workers", "0", "--loop.progress", "false",
            "--loop.mixed_precision", "no", "--optim.warmup_epochs", "0.5", "--output_dir", str(out)]  # fmt: skip
    if channels > 3:  # asked for; with one channel the default (ImageNet's, for RGB) is measured the same way
        args += ["--data.mean", "auto", "--data.std", "auto"]
    labeled = tmp_path / "labeled"
    if channels > 3:  # bands to show, and a labeled set in the same format for the k-NN monitor and downstream
        rng = np.random.default_rng(1)
        for label in range(2):
            folder = labeled / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(12):
                a = smooth(rng, channels) * 0.5
                a[..., label] += 0.5  # the class is which band is bright
                np.save(folder / f"{i:02d}.npy", a.astype(np.float32))
        args += ["--data.preview_bands", "[3, 2, 1]", "--monitor.knn_data", str(labeled)]
    AcceleratorState._reset_state(True)
    assert main([*args, "--loop.epochs", "1"]) == 0
    AcceleratorState._reset_state(True)
    assert main([*args, "--loop.epochs", "2"]) == 0  # resumes: the measured statistics are the same
    data_config = yaml.safe_load((out / "config.yaml").read_text())["data"]
    assert len(data_config["mean"]) == len(data_config["std"]) == channels  # measured, recorded
    path = out / "encoder.safetensors"
    meta = safe_open(str(path), "pt").metadata()
    record = read_spec(path)
    assert list(record.mean) == data_config["mean"] and len(record.std) == channels == record.in_chans
    assert json.loads(meta["model_args"])["in_chans"] == channels
    assert json.loads(meta["pretrained_cfg"])["mean"] == data_config["mean"]  # what timm normalises with
    vit = timm.create_model(meta["architecture"], pretrained=True, **json.loads(meta["model_args"]),
                            pretrained_cfg_overlay=dict(file=str(path), num_classes=0)).eval()  # fmt: skip
    vit.load_state_dict(load_file(path), strict=True)
    model = mae.load_pretrained(out).eval()
    x = torch.randn(2, channels, H, W)
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(x), model.encoder.forward_features(x))
    assert (out / "preview.png").is_file()
    image = sorted(data.iterdir())[0]
    assert (
        main(["visualize", "--checkpoint", str(out), "--images", str(image), "--output", str(tmp_path / "v.png")]) == 0
    )
    if channels > 3:  # the downstream stages read the same files and use the encoder's statistics
        evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
        # 24 labeled images, 20% of them (5) query the rest; the bright band sets the class, which even an
        # encoder one epoch old tells apart
        assert len(evals) == 2 and all(e["knn_top1"] >= 80.0 for e in evals), evals
        assert main(["visualize", "--checkpoint", str(out), "--images", str(image), "--bands", "[0, 5, 12]",
                     "--output", str(tmp_path / "bands.png")]) == 0  # fmt: skip
        shown, banded = (np.asarray(Image.open(tmp_path / f)) for f in ("v.png", "bands.png"))
        assert shown.shape == banded.shape and shown.shape[-1] == 3  # an RGB grid of the same layout ...
        assert not np.array_equal(shown, banded)  # ... showing other bands ([3, 2, 1] by default)
        common = ["--pretrained", str(out), "--data.path", str(labeled), "--loop.batch_size", "8",
                  "--data.num_workers", "0", "--loop.mixed_precision", "no"]  # fmt: skip
        quiet = ["--loop.progress", "false"]
        for stage, extra in (("linprobe", ["--loop.epochs", "3", *quiet]), ("finetune", ["--loop.epochs", "1", *quiet]),
                             ("knn", [])):  # fmt: skip
            AcceleratorState._reset_state(True)
            assert main([stage, *common, *extra, "--output_dir", str(tmp_path / stage)]) == 0, stage
        results = {
            stage: [json.loads(x) for x in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()][-1]
            for stage in ("linprobe", "finetune", "knn")
        }
        assert {r["samples"] for r in results.values()} == {2}, results  # 10% of the 24 images held out
        assert results["knn"]["top1"] == 100.0, results  # the encoder's measured statistics are used
        for stage in ("linprobe", "finetune"):
            weights = load_file(tmp_path / stage / "classifier.safetensors")
            assert weights["patch_embed.proj.weight"].shape[1] == channels and weights["head.weight"].shape[0] == 2
            meta = safe_open(str(tmp_path / stage / "classifier.safetensors"), "pt").metadata()
            assert json.loads(meta["pretrained_cfg"])["input_size"] == [channels, H, W]
            assert json.loads(meta["pretrained_cfg"])["mean"] == data_config["mean"], stage


def test_rgb_weights_adapt_to_other_channel_counts(tmp_path):
    path = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "rgb.safetensors")
    with pytest.warns(UserWarning, match="adapted to 1 channels"):
        gray = mae.load_pretrained(path, in_chans=1)
    assert gray.encoder.patch_embed.proj.weight.shape[1] == 1
    rgb = load_file(path)["patch_embed.proj.weight"]
    torch.testing.assert_close(gray.encoder.patch_embed.proj.weight[:, 0], rgb.sum(1))


def test_a_bands_first_array_is_named_as_such(tmp_path):
    np.save(tmp_path / "chw.npy", np.zeros((5, 40, 48), dtype=np.float32))
    expected = "chw.npy: 48 channel(s), but --model.in_chans is 5; its shape (5, 40, 48) looks like C x H x W; save "
    with pytest.raises(ChannelError, match=re.escape(expected + "arrays as H x W x C (np.moveaxis(a, 0, -1))")):
        PretrainSamples(FolderSource(tmp_path), img_size=(32, 32), patch_size=8, seed=0, in_chans=5)[(0, 0)]


def test_statistics_given_for_another_channel_count_are_a_one_line_error(tmp_path, capsys):
    data = write_folder(tmp_path / "imgs", 1, n=4, kind="png")
    AcceleratorState._reset_state(True)
    code = main(["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", "32",
                 "--model.in_chans", "1", "--data.path", str(data), "--data.mean", "[0.5, 0.5]",
                 "--output_dir", str(tmp_path / "o")])  # fmt: skip
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("mae pretrain")]
    assert code == 2 and err[-1].endswith("--data.mean [0.5, 0.5]: 2 values for --model.in_chans 1; give one per "
                                          "channel, or auto to measure them"), err  # fmt: skip


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. torch's on a read-only array of a PIL image
def test_stats_reads_rgb_by_default(tmp_path, capsys):
    from tests.conftest import make_images

    make_images(tmp_path / "imgs", n=6)
    assert main(["stats", "--data.path", str(tmp_path / "imgs")]) == 0
    mean = json.loads(capsys.readouterr().out.splitlines()[1].split(maxsplit=1)[1])
    assert len(mean) == 3 and all(0 < m < 1 for m in mean)


def test_stats_prints_per_channel_mean_and_std(tmp_path, capsys):
    data = write_folder(tmp_path / "imgs", 2, n=6)
    assert main(["stats", "--data.path", str(data), "--model.in_chans", "2"]) == 0
    out = capsys.readouterr().out
    stacked = np.stack([np.load(p) for p in sorted(data.iterdir())]).astype(np.float64).reshape(-1, 2)
    printed = {line.split()[0]: json.loads(line.split(maxsplit=1)[1]) for line in out.splitlines()[1:3]}
    np.testing.assert_allclose(printed["mean"], stacked.mean(0), atol=1e-5)
    np.testing.assert_allclose(printed["std"], stacked.std(0), atol=1e-5)
    assert "--data.mean" in out


def test_stats_reads_the_channel_count_from_the_files(tmp_path, capsys):
    data = write_folder(tmp_path / "bands", 13, n=4)
    assert main(["stats", "--data.path", str(data)]) == 0  # no --model.in_chans: the arrays say 13
    out = capsys.readouterr().out
    stacked = np.stack([np.load(p) for p in sorted(data.iterdir())]).astype(np.float64).reshape(-1, 13)
    printed = {line.split()[0]: json.loads(line.split(maxsplit=1)[1]) for line in out.splitlines()[1:3]}
    assert "13 channels" in out.splitlines()[0]
    np.testing.assert_allclose(printed["mean"], stacked.mean(0), atol=1e-5)
    np.testing.assert_allclose(printed["std"], stacked.std(0), atol=1e-5)
