"""`mae anomaly` end to end: a noise square pasted into smooth images is found (image and pixel AUROC, the map's
maximum inside the square), maps aligned with non-square inputs of 1 and 13 channels, the feature scores, two processes
giving one process's scores, and every bad input a one-line error."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors.torch import load_file

import mae
from mae.anomaly_maps import (
    encoder_features,
    gaussian_distance,
    load_with_decoder,
    patch_tokens,
    position_distance,
    position_maps,
)
from mae.api import run as api_run
from mae.cli import main
from mae.config import IMAGENET_MEAN, IMAGENET_STD
from mae.data.transforms import normalize
from mae.run_folder import decoder_beside
from mae.stages.anomaly import input_transform
from mae.weights.export import save_model

COMMON = ["--data.num_workers", "0", "--loop.mixed_precision", "no", "--loop.batch_size", "8"]


def run(*args) -> int:
    AcceleratorState._reset_state(True)
    return main(["anomaly", *COMMON, *map(str, args)])


def smooth(rng, n, size=32):
    """Smooth colour images [n, 32, 32, 3] uint8: a random 2x2 grid upsampled, so a masked patch follows from the
    visible ones (a 4x4 grid gives each 8-px patch a colour of its own, which no model can predict)."""
    coarse = rng.random((n, 2, 2, 3)) * 255
    up = [Image.fromarray(c.astype("uint8")).resize((size, size), Image.BICUBIC) for c in coarse]
    return np.stack([np.asarray(img) for img in up])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A micro MAE trained for 150 steps on smooth images (~10-15 s on 2 shared cores), saved with its decoder."""
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32, norm_pix_loss=False)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = np.random.default_rng(0)
    for _ in range(150):
        x = normalize(torch.from_numpy(smooth(rng, 32)).permute(0, 3, 1, 2), IMAGENET_MEAN, IMAGENET_STD)
        loss = model(x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_model(model, tmp_path_factory.mktemp("run") / "mae.safetensors")


@pytest.fixture(scope="module")
def mvtec(tmp_path_factory):
    """MVTec AD's layout: test/good (smooth), test/noise (a 9-px noise square pasted), ground_truth/noise masks."""
    root = tmp_path_factory.mktemp("mvtec")
    rng = np.random.default_rng(1)
    boxes = {}
    for kind in ("good", "noise"):
        (root / "test" / kind).mkdir(parents=True)
        for i, img in enumerate(smooth(rng, 20)):
            if kind == "noise":
                top, left = rng.integers(0, 32 - 9, 2)
                img[top : top + 9, left : left + 9] = rng.integers(0, 256, (9, 9, 3))
                mask = np.zeros((32, 32), np.uint8)
                mask[top : top + 9, left : left + 9] = 255
                (root / "ground_truth" / kind).mkdir(parents=True, exist_ok=True)
                Image.fromarray(mask).save(root / "ground_truth" / kind / f"{i:03d}_mask.png")
                boxes[f"noise__{i:03d}"] = (top, left)
            Image.fromarray(img).save(root / "test" / kind / f"{i:03d}.png")
    return root, boxes


def test_a_noise_square_is_found(tmp_path, trained, mvtec):
    root, boxes = mvtec
    out = tmp_path / "out"
    assert run("--pretrained", trained, "--data.path", root / "test", "--output_dir", out) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["normal"] == metrics["anomalous"] == 20 and metrics["pixel_images"] == 40
    assert metrics["auroc"] > 0.95 and metrics["aupr"] > 0.95 and metrics["pixel_auroc"] > 0.8, metrics
    inside = 0
    for name, (top, left) in boxes.items():
        m = np.load(out / "maps" / f"{name}.npy")
        assert m.shape == (32, 32)
        r, c = np.unravel_index(m.argmax(), m.shape)
        inside += top <= r < top + 9 and left <= c < left + 9
    assert inside >= 0.9 * len(boxes), inside
    rows = list(csv.DictReader((out / "scores.csv").open()))
    assert [r["rank"] for r in rows] == [str(i) for i in range(1, 41)]
    assert {"file", "score", "rank", "class", "anomalous"} == set(rows[0])
    for name in ("most_anomalous.png", "roc.png", "maps/good__000.png"):
        assert (out / name).is_file()
    # the figure draws the 32-px images enlarged (image, overlay, map; 8 rows), the overlays at the maps' size
    assert Image.open(out / "most_anomalous.png").size == (3 * 128 + 4 * 2, 8 * 128 + 9 * 2)
    assert Image.open(out / "maps" / "good__000.png").size == (32, 32)


def silent(tmp_path, in_chans, img_size):
    """A saved MAE whose decoder predicts 0: its map is the normalised input squared (mean over channels)."""
    model = mae.create_mae("mae_vit_micro_patch8", in_chans=in_chans, img_size=img_size, norm_pix_loss=False)
    torch.nn.init.zeros_(model.decoder.pred.weight)
    torch.nn.init.zeros_(model.decoder.pred.bias)
    return save_model(model, tmp_path / f"silent{in_chans}.safetensors")


def test_position_maps_find_a_noise_square(tmp_path, trained, mvtec):
    """--score gaussian --features positions: without reconstruction, the patches' distances to their positions'
    Gaussians, upsampled to the input's size, are the map; its highest 8-px block overlaps the noise square, image
    and pixel AUROC and PRO are reported, and most_anomalous.png shows the maps."""
    root, boxes = mvtec
    train = tmp_path / "train"
    train.mkdir()
    for i, img in enumerate(smooth(np.random.default_rng(7), 64)):
        Image.fromarray(img).save(train / f"{i}.png")
    out = tmp_path / "out"
    args = ["--score", "gaussian", "--features", "positions", "--train_path", train]
    assert run("--pretrained", trained, "--data.path", root / "test", "--output_dir", out, *args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["features"] == "positions" and metrics["pixel_images"] == 40
    assert metrics["auroc"] > 0.95 and metrics["pixel_auroc"] > 0.8 and metrics["pixel_pro"] > 0.5, metrics
    overlaps = 0
    for name, (top, left) in boxes.items():
        m = np.load(out / "maps" / f"{name}.npy")
        assert m.shape == (32, 32)
        blocks = m.reshape(4, 8, 4, 8).mean((1, 3))
        r, c = (int(i) * 8 for i in np.unravel_index(blocks.argmax(), (4, 4)))  # its highest block's corner
        overlaps += r < top + 9 and top < r + 8 and c < left + 9 and left < c + 8
    assert overlaps >= 0.9 * len(boxes), overlaps
    assert (out / "most_anomalous.png").is_file() and (out / "maps" / "good__000.png").is_file()


@pytest.mark.parametrize("in_chans", [1, 13])
def test_maps_are_aligned_with_non_square_inputs(tmp_path, in_chans):
    """Files of the model's size give the map of the input exactly; a file twice as large is resized whole."""
    weights = silent(tmp_path, in_chans, (24, 40))
    data = tmp_path / "data"
    data.mkdir()
    for name, (h, w), scale in (("same", (24, 40), 1), ("twice", (48, 80), 2)):
        a = np.zeros((h, w, in_chans), np.float32)
        a[3 * scale : 9 * scale, 20 * scale : 29 * scale] = 1.0
        if in_chans == 1:
            Image.fromarray((a[..., 0] * 255).astype(np.uint8)).save(data / f"{name}.png")
        else:
            np.save(data / f"{name}.npy", a)
    out = tmp_path / "out"
    stats = ["--data.mean", f"[{','.join(['0'] * in_chans)}]", "--data.std", f"[{','.join(['1'] * in_chans)}]"]
    assert run("--pretrained", weights, "--data.path", data, "--output_dir", out, *stats) == 0
    same = np.load(out / "maps" / "same.npy")
    expected = np.zeros((24, 40), np.float32)
    expected[3:9, 20:29] = 1.0
    np.testing.assert_allclose(same, expected, atol=1e-6)
    twice = np.load(out / "maps" / "twice.npy")
    assert twice.shape == (24, 40) and twice[4:8, 21:28].min() > 0.9 and twice[expected == 0].max() < 0.3


def test_position_maps_of_non_square_13_channel_images(tmp_path):
    """--features positions on a model of 24 x 40 px and 13 channels: a map per image at the model's size, the
    image's distances at its 3 x 5 patch positions upsampled (`position_maps`), whose mean is the score."""
    weights = silent(tmp_path, 13, (24, 40))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(3)
    for i in range(12):
        np.save(data / f"{i:02d}.npy", rng.random((24, 40, 13), dtype=np.float32))
    out = tmp_path / "out"
    stats = ["--data.mean", f"[{','.join(['0.5'] * 13)}]", "--data.std", f"[{','.join(['0.3'] * 13)}]"]
    args = ["--score", "gaussian", "--features", "positions", "--train_path", data, "--shrinkage", "0.1"]
    assert run("--pretrained", weights, "--data.path", data, "--output_dir", out, *stats, *args) == 0
    rows = {r["file"]: float(r["score"]) for r in csv.DictReader((out / "scores.csv").open())}
    assert len(rows) == 12
    model = mae.load_pretrained(weights).eval()
    files = sorted(data.iterdir())
    x = normalize(torch.stack([torch.from_numpy(np.load(f)).permute(2, 0, 1) for f in files]), [0.5] * 13, [0.3] * 13)
    distances = position_distance(patch_tokens(model, x), patch_tokens(model, x), 0.1)
    expected = position_maps(distances, model)
    for i, f in enumerate(files):
        m = np.load(out / "maps" / f"{f.stem}.npy")
        assert m.shape == (24, 40)
        np.testing.assert_allclose(m, expected[i].numpy(), rtol=1e-3, atol=1e-4)
        assert rows[str(f)] == pytest.approx(float(distances[i].mean()), rel=1e-4)


@pytest.mark.parametrize("features", ["full", "positions"])
def test_recon_leaves_features_aside(tmp_path, features):
    """--score recon takes no features: with --features full or positions it reads no training images (none is
    given, the weights have no run folder) and writes the default's scores and maps, the reconstruction error's."""
    weights = silent(tmp_path, 1, (24, 32))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(4)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (24, 32), dtype=np.uint8)).save(data / f"{i}.png")
    stats = ["--data.mean", "[0.5]", "--data.std", "[0.25]"]
    outs = {f: tmp_path / f for f in ("default", features)}
    assert run("--pretrained", weights, "--data.path", data, "--output_dir", outs["default"], *stats) == 0
    assert run("--pretrained", weights, "--data.path", data, "--output_dir", outs[features], *stats,
               "--features", features) == 0  # fmt: skip
    scores = {f: (out / "scores.csv").read_text() for f, out in outs.items()}
    assert scores[features] == scores["default"] and len(scores["default"].splitlines()) == 7
    for i in range(6):
        maps = [np.load(out / "maps" / f"{i}.npy") for out in outs.values()]
        assert maps[0].shape == (24, 32) and (maps[0] == maps[1]).all()


@pytest.mark.parametrize(
    ("score", "columns", "features"),
    [("knn", ["knn"], "full"), ("gaussian", ["gaussian"], "full"), ("gaussian", ["gaussian"], None),
     ("gaussian", ["gaussian"], "positions"), ("both", ["recon", "knn"], "full"),
     ("all", ["recon", "knn", "gaussian"], None)],
)  # fmt: skip
def test_feature_scores(tmp_path, trained, mvtec, score, columns, features):
    """--score knn / gaussian / both / all: the columns of scores.csv and metrics.json, in the order the first of
    which metrics.json's auroc judges; the gaussian column is `gaussian_distance` of the encoder features (of the
    whole image, or with --features masked, the default (None: left out), of its --masks masked views), at the
    default --shrinkage (gaussian) and at another (all); with --features positions, `position_distance` of the
    whole image's tokens, averaged over the positions."""
    root, _ = mvtec
    train = tmp_path / "train"
    train.mkdir()
    for i, img in enumerate(smooth(np.random.default_rng(5), 24)):
        Image.fromarray(img).save(train / f"{i}.png")
    out = tmp_path / score
    options = {"shrinkage": 10.0} if score == "all" else {}
    options |= {"features": features} if features else {}
    features = features or "masked"
    result = api_run("anomaly", pretrained=str(trained), data={"path": str(root / "test"), "num_workers": 0},
                     train_path=str(train), score=score, save_maps=False, output_dir=str(out),
                     loop={"mixed_precision": "no"}, **options)  # fmt: skip
    assert {f"{c}_{m}" for c in columns for m in ("auroc", "aupr")} <= set(result.metrics)
    assert result.metrics["auroc"] == result.metrics[f"{columns[0]}_auroc"]
    rows = list(csv.DictReader((out / "scores.csv").open()))
    assert len(rows) == 40 and not (out / "maps").exists()
    if len(columns) == 1:
        assert {"score", "rank"} <= set(rows[0]) and not any(k.endswith("_score") for k in rows[0])
    else:
        assert [k for k in rows[0] if k.endswith("_score")] == [f"{c}_score" for c in columns]
    if "gaussian" in columns:
        shrinkage = options.get("shrinkage", 1e-3)
        model = load_with_decoder(trained).eval()
        stats = json.loads((out / "metrics.json").read_text())
        assert stats["shrinkage"] == shrinkage and stats["features"] == features
        read = input_transform(tuple(model.img_size), IMAGENET_MEAN, IMAGENET_STD)  # a file without statistics

        masks = 4 if features == "masked" else 0  # --masks and --seed at their defaults

        def features_of(paths):
            x = torch.stack([read(Image.open(p).convert("RGB")) for p in paths])
            with torch.no_grad():
                return patch_tokens(model, x) if features == "positions" else encoder_features(model, x, masks, 0)

        bank = features_of(sorted(train.iterdir()))
        tests = sorted((root / "test").rglob("*.png"))
        if features == "positions":
            expected = position_distance(bank, features_of(tests), shrinkage).mean(1)
        else:
            expected = gaussian_distance(bank, features_of(tests), shrinkage)
        column = "score" if len(columns) == 1 else "gaussian_score"
        got = {Path(r["file"]).parts[-2:]: float(r[column]) for r in rows}
        np.testing.assert_allclose([got[p.parts[-2:]] for p in tests], expected.numpy(), rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("score", ["recon", "positions"])
def test_two_processes_give_the_same_scores(tmp_path, trained, mvtec, score):
    """The maps' scores, and the Gaussian per patch position (its training tokens gathered from both processes)."""
    root, _ = mvtec
    args = ["anomaly", *COMMON, "--loop.batch_size", "3", "--pretrained", str(trained), "--data.path",
            str(root / "test"), "--save_maps", "false"]  # fmt: skip
    if score == "positions":  # the normal test images as the training images: 20 of them, 3 to a batch
        args += ["--score", "gaussian", "--features", "positions", "--train_path", str(root / "test" / "good")]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "mae", *args, "--output_dir", str(tmp_path / "two")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    AcceleratorState._reset_state(True)
    assert main([*args, "--output_dir", str(tmp_path / "one")]) == 0

    def scores(folder):
        return {r["file"]: float(r["score"]) for r in csv.DictReader((folder / "scores.csv").open())}

    one, two = scores(tmp_path / "one"), scores(tmp_path / "two")
    assert one.keys() == two.keys() and len(one) == 40
    np.testing.assert_allclose([two[k] for k in one], list(one.values()), rtol=1e-5)


def test_a_converted_encoder_only_file_says_a_trained_decoder_is_needed(tmp_path, capsys, trained, mvtec):
    """`mae convert` of an encoder-only .pth writes the encoder export (no decoder, fresh or other; said in one line);
    `mae anomaly` of it stops with one line for every score that reads reconstructions, and scores k-NN from the
    encoder alone exactly as the run it came from does."""
    root, _ = mvtec
    encoder = mae.load_pretrained(trained).encoder.state_dict()  # timm keys: the official encoder-only layout
    torch.save({"model": encoder}, tmp_path / "encoder.pth")
    converted = tmp_path / "converted.safetensors"
    assert main(["convert", str(tmp_path / "encoder.pth"), "--output", str(converted), "--num_heads", "3"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and "encoder-only" in printed[0] and "holds no decoder weights" in printed[0]
    written = load_file(converted)
    assert written.keys() == encoder.keys() and all(torch.equal(written[k], encoder[k]) for k in encoder)
    assert not decoder_beside(converted).exists()
    data = ["--data.path", root / "test", "--train_path", root / "test" / "good"]
    for score in ("recon", "both", "all"):
        assert run("--pretrained", converted, *data, "--score", score, "--output_dir", tmp_path / score) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "reconstruction maps need its trained decoder" in err[0], err
        assert err[0].endswith(f"or use --score knn or gaussian (the encoder alone) instead of --score {score}")
    for name, source in (("converted", converted), ("run", trained)):
        assert run("--pretrained", source, *data, "--score", "knn", "--output_dir", tmp_path / name) == 0
    assert (tmp_path / "converted" / "scores.csv").read_text() == (tmp_path / "run" / "scores.csv").read_text()


@pytest.mark.parametrize(
    "case,expected",
    [
        ("encoder_only", "holds an encoder only, and reconstruction maps need its trained decoder: give a pretraining"),
        ("no_pretrained", "--pretrained: required"),
        ("missing_pretrained", "--pretrained /no/such: no such file or folder"),
        ("normal_not_a_class", "--normal shiny: not a class of --data.path (its classes: good, noise)"),
        ("normal_unlabeled", "has no classes; give a folder with one subfolder per class"),
        ("knn_without_train", "--train_path: required with --score knn"),
        ("gaussian_without_train", "--train_path: required with --score gaussian"),
        ("shrinkage_out_of_range", "--shrinkage 0.0: must be > 0"),
        ("positions_with_knn", "--features positions: a Gaussian per patch position, for --score gaussian"),
        ("channels_without_stats", "--data.mean: the run at"),
        ("masks_out_of_range", "--masks 1: must be >= 2"),
        ("too_many_masks", "--masks 99: at most 16"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, trained, mvtec, case, expected):
    root, _ = mvtec
    args = ["--pretrained", trained, "--data.path", root / "test", "--output_dir", tmp_path / "o"]
    if case == "encoder_only":
        args[1] = mae.export_encoder(mae.load_pretrained(trained), tmp_path / "encoder.safetensors")
    elif case == "no_pretrained":
        args = args[2:]
    elif case == "missing_pretrained":
        args[1] = "/no/such"
    elif case == "normal_not_a_class":
        args += ["--normal", "shiny"]
    elif case == "normal_unlabeled":
        args[3] = root / "test" / "good"
        args += ["--normal", "good"]
    elif case in ("knn_without_train", "gaussian_without_train"):
        args += ["--score", case.split("_")[0]]
    elif case == "positions_with_knn":
        args += ["--score", "all", "--features", "positions"]
    elif case == "shrinkage_out_of_range":
        args += ["--shrinkage", 0]
    elif case == "channels_without_stats":
        args[1] = silent(tmp_path, 2, 32)
    elif case == "masks_out_of_range":
        args += ["--masks", 1]
    elif case == "too_many_masks":
        args += ["--masks", 99]
    assert run(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
