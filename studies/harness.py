"""What every study does around a stage: run it through the public Python API (`mae.pretrain(...)`, `mae.linprobe(...)`,
...) once, time it, read its last evaluation from the files it writes, and write a table with its JSON.

A finished stage leaves `RUN.seconds` beside its output folder `RUN` (its wall-clock seconds), so a study stopped
half-way resumes where it stopped: finished stages are not run again, and an unfinished one resumes from its own
checkpoints (`--resume auto`, every stage's default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import mae

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def seconds_file(run: Path) -> Path:
    """RUN.seconds beside the output folder (appended, not with_suffix: run names may hold dots)."""
    return run.parent / f"{run.name}.seconds"


def finished(run: Path) -> bool:
    return seconds_file(run).exists()


def stage(name: str, run: Path, config: str | Path | None = None, **overrides: Any) -> float:
    """`mae.<name>(config, output_dir=run, **overrides)` unless it finished before; its wall-clock seconds. A
    `mae.MaeError` (bad options, unreadable data) ends the study with the stage's one line, naming the run."""
    done = seconds_file(run)
    if done.exists():
        return float(done.read_text())
    start = time.perf_counter()
    try:
        getattr(mae, name)(config, output_dir=str(run), **overrides)
    except mae.MaeError as e:
        sys.exit(f"study: mae.{name} into {run}: {e}")
    seconds = time.perf_counter() - start
    write_whole(done, str(seconds))
    return seconds


def merge(*sections: dict) -> dict:
    """Recipe sections (`{"loop": {"epochs": 1}}`) merged key by key at every depth, later ones winning: several
    recipe files or changes given as one set of `mae.<stage>` overrides."""
    out: dict = {}
    for section in sections:
        for key, value in section.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both else value
    return out


def last_eval(run: Path) -> dict:
    """The last evaluation line of a training stage's metrics.jsonl (the one with `top1`)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if "top1" in m][-1]


def run_config(run: Path) -> dict:
    """The resolved config a stage saved in its output folder (config.yaml)."""
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def load_split(data: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A split prepared by scripts/prepare_fashion_mnist.py as (uint8 images [N, 28, 28], int64 labels [N])."""
    import datasets

    ds = datasets.load_from_disk(str(data / split)).with_format("numpy")
    return np.stack(list(ds["image"])), np.asarray(ds["label"], dtype=np.int64)


def cpu() -> str:
    """The CPU's model and its AVX-512 / AMX units (what decides bf16's speed), as the studies record it."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("Model name")), "unknown CPU")
    flags = next((x for x in lines if x.startswith("Flags")), "")
    isa = ", ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags) or "no AVX-512"
    return f"{model} ({isa})"


def machine() -> str:
    import torch

    return f"{cpu()}, {os.cpu_count()} cores, torch {torch.__version__}"


def write_whole(path: Path, text: str) -> None:
    """Written whole or not at all: a kill here never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report(out: Path, name: str, table: str, data: Any) -> None:
    """OUT/NAME.md (the table) and OUT/NAME.json (the numbers behind it); the table printed."""
    write_whole(out / f"{name}.json", json.dumps(data, indent=1))
    write_whole(out / f"{name}.md", table if table.endswith("\n") else table + "\n")
    print(table)
