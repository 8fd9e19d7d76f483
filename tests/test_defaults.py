"""Every stage through the command line at its defaults: only paths, size, epochs and batch size given.

Recipes set many options; users often set none. This is what a new user's first commands run.
"""

import json

import pytest
from accelerate.state import AcceleratorState

from mae.cli import main
from tests.conftest import make_images, make_labeled


def cli(*args) -> int:
    AcceleratorState._reset_state(True)
    return main([str(a) for a in args])


def evals(out) -> list[dict]:
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval" in m]


@pytest.mark.slow
def test_every_stage_runs_at_its_defaults(tmp_path, capsys):
    make_images(tmp_path / "imgs", n=16)
    labeled = make_labeled(tmp_path / "labeled", per_class=12)
    size = ["--model.img_size", 32]
    pre = tmp_path / "pre"
    assert cli("pretrain", "--data.path", tmp_path / "imgs", "--output_dir", pre, *size,
               "--loop.epochs", 1, "--loop.batch_size", 8) == 0  # fmt: skip
    assert (pre / "encoder.safetensors").is_file() and (pre / "preview.png").is_file()

    common = ["--pretrained", pre, "--data.path", labeled, "--loop.epochs", 2, "--loop.batch_size", 8]
    for mode in ("cached", "augmented"):
        assert cli("linprobe", *common, "--mode", mode, "--output_dir", tmp_path / mode) == 0
        assert evals(tmp_path / mode)[-1]["top1"] >= 0
    assert cli("finetune", *common, "--output_dir", tmp_path / "ft") == 0
    assert (tmp_path / "ft" / "classifier.safetensors").is_file()
    assert cli("knn", "--pretrained", pre, "--data.path", labeled, "--loop.batch_size", 8,
               "--output_dir", tmp_path / "knn") == 0  # fmt: skip
    assert evals(tmp_path / "knn")[-1]["top1"] >= 0
    assert cli("export", "--checkpoint", pre, "--output", tmp_path / "enc.safetensors") == 0
    image = next((labeled / "red").iterdir())
    assert cli("visualize", "--checkpoint", pre, "--images", image, "--output", tmp_path / "rec.png") == 0
    att = tmp_path / "att.png"
    assert cli("visualize", "--attention", "--pretrained", pre, "--images", image, "--output", att) == 0
    assert (tmp_path / "rec.png").is_file() and att.is_file()

    out = capsys.readouterr()
    assert "Traceback" not in out.err
    # The probe and fine-tuning show their accuracy on the console, not only in metrics.jsonl.
    assert out.out.count("top1") >= 3
    # Default warm-ups (40, 10, 5 epochs) are longer than these runs: each stage says so at start.
    assert out.err.count("--optim.warmup_epochs") >= 3
