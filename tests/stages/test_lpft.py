"""Fine-tuning never loses to the probe on a small labeled folder (issue: 4 classes, 256 generated 64-px images, an
encoder pretrained for 3 epochs), with the small-data recipes as a user runs them; the fine-tune starts from the
probe (LP-FT) and logs it."""

import json
from pathlib import Path

import numpy as np
import pytest
from accelerate.state import AcceleratorState
from PIL import Image

import mae


def pattern_folder(root: Path, per_class: int = 64, size: int = 32, seed: int = 0) -> Path:
    """Four classes told apart by pattern only (horizontal, vertical, diagonal stripes, a checker board), each image
    in two random colours with a random period, phase and noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(float)
    for c in range(4):
        folder = root / f"pattern{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            period, phase = rng.uniform(3, 7) * size / 32, rng.uniform(0, 2 * np.pi)
            if c < 3:
                wave = np.sin(2 * np.pi * [yy, xx, (xx + yy) / 1.4][c] / period + phase)
            else:
                wave = np.sin(2 * np.pi * xx / period + phase) * np.sin(2 * np.pi * yy / period)
            a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
            img = a + (b - a) * (wave[..., None] > 0) + rng.normal(0, 25, (size, size, 3))
            Image.fromarray(img.clip(0, 255).astype("uint8")).save(folder / f"{i:03d}.png")
    return root


@pytest.mark.slow
def test_the_small_data_fine_tune_is_at_least_its_probe(tmp_path, capsys):
    data = pattern_folder(tmp_path / "data")
    AcceleratorState._reset_state(True)
    pre = mae.pretrain(data={"path": data}, model={"name": "mae_vit_micro_patch8", "img_size": 32},
                       loop={"epochs": 3, "batch_size": 32, "progress": False}, optim={"warmup_epochs": 1},
                       output_dir=tmp_path / "pre")  # fmt: skip
    recipes = Path(__file__).parents[2] / "recipes"
    AcceleratorState._reset_state(True)
    probe = mae.linprobe(recipes / "linprobe" / "small_cpu.yaml", pretrained=pre.output_dir, data={"path": data},
                         loop={"progress": False}, output_dir=tmp_path / "lp")  # fmt: skip
    AcceleratorState._reset_state(True)
    ft = mae.finetune(recipes / "finetune" / "small_cpu.yaml", pretrained=pre.output_dir, data={"path": data},
                      loop={"progress": False}, output_dir=tmp_path / "ft")  # fmt: skip
    assert ft.metrics["samples"] == probe.metrics["samples"] == 26  # the same held-out images (seed 0)
    assert ft.metrics["top1"] >= probe.metrics["top1"], (ft.metrics, probe.metrics)
    lines = [json.loads(s) for s in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["eval"] == "probe_init" and lines[0]["step"] == 0  # the starting point, logged first
    warned = "below the" in capsys.readouterr().err  # said at the end exactly when the fine-tune ends below its start
    assert warned == (ft.metrics["top1"] < lines[0]["top1"])


@pytest.mark.parametrize(("final", "main_process", "probe", "said"), [
    (70.0, True, True, True), (80.0, True, True, False), (90.0, True, True, False), (70.0, False, True, False),
    (70.0, True, False, False),
])  # fmt: skip
def test_a_fine_tune_ending_below_its_probe_says_so_on_the_main_process(tmp_path, capsys, final, main_process, probe,
                                                                         said):  # fmt: skip
    from types import SimpleNamespace

    from mae.stages.finetune import _compare_with_probe

    start = {"step": 0, "epoch": 0, "loss": 0.9, "eval": "probe_init" if probe else "val", "top1": 80.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    setup = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=main_process))
    _compare_with_probe(setup, tmp_path, {"eval": "val", "top1": final})
    err = capsys.readouterr().err
    assert err == ("warning: fine-tuning ended at top1 70.00%, below the 80.00% of the linear probe it started from: "
                   "train longer (--loop.min_steps), lower --optim.blr, or freeze blocks (--model.frozen_blocks); the "
                   "probe itself is what `mae linprobe` gives\n" if said else "")  # fmt: skip
    assert err.count("\n") == int(said)  # one line
