"""`mae anomaly` at its defaults (no --score): a micro MAE pretrained by `mae.pretrain` on one synthetic texture
(horizontal stripes) finds the other textures and a pasted square of another texture, scoring by a Gaussian per patch
position because its run records the training images, and says so in its first line; without known training images it
falls back on the reconstruction maps, and says why."""

import csv
import json
import shutil

import numpy as np
import pytest
import yaml
from accelerate.state import AcceleratorState

import mae
from mae.anomaly_maps import auroc
from mae.cli import main
from tests.textures import KINDS, texture_set

COMMON = ["--data.num_workers", "0", "--loop.mixed_precision", "no"]


@pytest.fixture(scope="module")
def textures(tmp_path_factory):
    """(the texture folders, a pretraining run on their train/good): 96 images, 60 epochs (~10 s on 2 cores)."""
    root = texture_set(tmp_path_factory.mktemp("textures"))
    run = tmp_path_factory.mktemp("run") / "pretrain"
    AcceleratorState._reset_state(True)
    mae.pretrain(output_dir=str(run), seed=0, data={"path": str(root / "train"), "num_workers": 0},
                 model={"name": "mae_vit_micro_patch8", "img_size": 32, "norm_pix_loss": False},
                 optim={"blr": 1e-2, "warmup_epochs": 5},
                 loop={"epochs": 60, "batch_size": 32, "progress": False, "mixed_precision": "no", "eval_every": 1000,
                       "checkpoint_every": 100000})  # fmt: skip
    return root, run


def anomaly(capsys, *args) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines)."""
    AcceleratorState._reset_state(True)
    capsys.readouterr()
    code = main(["anomaly", *COMMON, *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.strip().splitlines()


def test_the_defaults_find_other_textures_and_a_pasted_square(tmp_path, capsys, textures):
    root, run = textures
    out = tmp_path / "out"
    code, lines, _ = anomaly(capsys, "--pretrained", run, "--data.path", root / "test", "--output_dir", out)
    assert code == 0
    assert lines[0] == (f"anomaly: scoring by --score gaussian --features positions (a Gaussian per patch position): "
                        f"the run records its normal training images ({root / 'train'})")  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["score"] == "gaussian" and metrics["features"] == "positions"
    assert metrics["choice"].startswith("the run records its normal training images")
    assert metrics["auroc"] >= 0.9 and metrics["pixel_auroc"] >= 0.9, metrics
    assert metrics["pixel_images"] == 16 + 12 and 0.5 < metrics["pixel_pro"] <= 1.0, metrics
    rows = list(csv.DictReader((out / "scores.csv").open()))
    score = {c: np.array([float(r["score"]) for r in rows if r["class"] == c]) for c in {r["class"] for r in rows}}
    for kind in [*KINDS[1:], "pasted"]:  # each kind of anomaly apart, against the normal stripes
        found = auroc(np.r_[score["good"], score[kind]], np.r_[np.zeros(16), np.ones(len(score[kind]))])
        assert found >= 0.9, (kind, found)
    m = np.load(out / "maps" / "pasted__000.npy")
    assert m.shape == (32, 32) and len(np.unique(m)) > 16  # upsampled smoothly, not one value per patch


def test_without_known_training_images_the_reconstruction_maps(tmp_path, capsys, textures):
    """A run whose recorded data.path is gone scores by reconstruction, saying why; --train_path brings the
    Gaussian back; an explicit --score is taken as given."""
    root, run = textures
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    config = yaml.safe_load((moved / "config.yaml").read_text())
    config["data"]["path"] = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    data = ["--data.path", root / "test", "--save_maps", "false"]
    code, lines, _ = anomaly(capsys, "--pretrained", moved, *data, "--output_dir", tmp_path / "a")
    assert code == 0
    assert lines[0] == (f"anomaly: scoring by --score recon: no normal training images (the run's recorded data.path "
                        f"{tmp_path / 'gone'} is not found here); give --train_path for a Gaussian per patch "
                        "position")  # fmt: skip
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["score"] == "recon"
    code, lines, _ = anomaly(capsys, "--pretrained", moved, *data, "--output_dir", tmp_path / "b", "--train_path",
                          root / "train")  # fmt: skip
    assert code == 0 and lines[0].endswith(f"the normal training images are given (--train_path {root / 'train'})")
    code, lines, _ = anomaly(capsys, "--pretrained", run, *data, "--output_dir", tmp_path / "c", "--score", "knn")
    assert code == 0 and lines[0] == "anomaly: scoring by --score knn --features masked: as given"


def test_an_encoder_alone_without_training_images_asks_for_them(tmp_path, capsys, textures):
    root, run = textures
    code, _, err = anomaly(capsys, "--pretrained", run / "encoder.safetensors", "--data.path", root / "test",
                           "--output_dir", tmp_path / "o")  # fmt: skip
    assert code == 2 and len(err) == 1 and err[0].endswith("or --train_path (the normal training images; the default "
                                                           "then scores by a Gaussian per patch position from the "
                                                           "encoder alone)"), err  # fmt: skip


def test_mask_path(tmp_path, capsys, textures):
    """--mask_path: masks kept elsewhere judge the maps as ground_truth/ beside the images does; a folder without
    masks for these images is one line."""
    root, run = textures
    masks = tmp_path / "masks"
    shutil.copytree(root / "ground_truth", masks)
    data = ["--pretrained", run, "--data.path", root / "test", "--save_maps", "false"]
    assert anomaly(capsys, *data, "--output_dir", tmp_path / "a")[0] == 0
    assert anomaly(capsys, *data, "--output_dir", tmp_path / "b", "--mask_path", masks)[0] == 0
    a, b = (json.loads((tmp_path / x / "metrics.json").read_text()) for x in "ab")
    assert a["pixel_auroc"] == b["pixel_auroc"] and a["pixel_pro"] == b["pixel_pro"]
    code, _, err = anomaly(capsys, *data, "--output_dir", tmp_path / "c", "--mask_path", tmp_path)
    assert code == 2 and len(err) == 1 and "holds no <defect>/<name>_mask.png" in err[0], err
