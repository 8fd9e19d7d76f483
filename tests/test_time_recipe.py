"""scripts/time_recipe.py: the JSON it keeps says what ran, on what, how many steps and how long, and projects a
longer run from the measured pace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import make_images

ROOT = Path(__file__).resolve().parents[1]


def test_time_recipe_keeps_the_run_and_projects_the_full_one(tmp_path):
    make_images(tmp_path / "pictures", n=16)
    out = tmp_path / "timing.json"
    argv = ["pretrain", "--data.path", str(tmp_path / "pictures"), "--model.name", "mae_vit_micro_patch8",
            "--model.img_size", "32", "--loop.epochs", "2", "--loop.batch_size", "8", "--loop.log_every", "1",
            "--optim.warmup_epochs", "0.5", "--data.num_workers", "0", "--loop.mixed_precision", "no"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(ROOT / "scripts" / "time_recipe.py"), "--out", str(out), "--full_steps", "40", "--"]
    done = subprocess.run([*script, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["steps"] == 4 and record["command"] == "python -m mae " + " ".join(argv)  # 16 // 8 = 2 a epoch
    assert record["cpu"]["model_name"] and record["cpu"]["cores"] >= 1 and "torch" in record["packages"]
    per_step = 8 / record["img_per_s"]
    expected = (record["seconds"] + 36 * per_step) / 60
    assert abs(record["full_minutes"] - expected) <= 0.051 and record["full_minutes"] >= record["seconds"] / 60 - 0.05
