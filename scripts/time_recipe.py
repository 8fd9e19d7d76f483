"""How long a recipe's stage takes on this machine, kept as JSON: the CPU (lscpu's model name, its core count and
whether it has AVX-512), torch, the command, the optimizer steps run and their wall-clock, and the seconds a step
takes once running (the median over logged lines after the first, so start-up and compilation are left out). A
shorter run than the recipe's (fewer epochs, a subset) then gives the full run's minutes as the measured wall-clock
plus the steps it did not run at the measured pace: `--full_steps N` writes that projection beside the measurement.

    python scripts/time_recipe.py --out docs/results/timing/finetune.json --full_steps 1872 -- \\
        finetune --config recipes/fashion_mnist/finetune.yaml --pretrained RUN --data.path DATA ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu() -> dict:
    """lscpu's model name, the cores this process may use and the AVX-512 / AMX flags (Linux)."""
    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True,
                  text=True).stdout.splitlines() if line.startswith("Model name")), platform.processor())  # fmt: skip
    flags = (
        Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n")[0] if Path("/proc/cpuinfo").exists() else ""
    )
    return {"model_name": model, "cores": len(os.sched_getaffinity(0)), "avx512f": " avx512f" in flags,
            "avx512_bf16": " avx512_bf16" in flags, "amx_bf16": " amx_bf16" in flags}  # fmt: skip


def packages() -> dict:
    """The versions of what a run depends on (the tested-versions table cites them)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "timm", "accelerate", "jsonargparse", "safetensors", "numpy", "pillow", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def measure(argv: list[str], full_steps: int | None) -> dict:
    """Run `python -m mae ARGV` in a fresh output folder and read its metrics.jsonl."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = argv[argv.index("--output_dir") + 1] if "--output_dir" in argv else tmp  # kept when given
        extra = [] if "--output_dir" in argv else ["--output_dir", tmp]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mae", *argv, *extra, "--loop.progress", "false"], check=True)
        seconds = time.perf_counter() - start
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "img_per_s" in r and "eval" not in r]
    batch = (
        next(int(argv[i + 1]) for i, a in enumerate(argv) if a == "--loop.batch_size")
        if "--loop.batch_size" in argv
        else None
    )
    record = {"command": "python -m mae " + " ".join(argv), "cpu": cpu(), "torch": torch.__version__,
              "packages": packages(), "os": platform.platform(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"),
              "steps": steps[-1]["step"], "seconds": round(seconds, 1),
              "img_per_s": round(statistics.median(r["img_per_s"] for r in steps[1:] or steps), 1)}  # fmt: skip
    if full_steps is not None:
        if batch is None:
            raise SystemExit("--full_steps needs --loop.batch_size in the command (the images of one step)")
        per_step = batch / record["img_per_s"]
        record["full_steps"] = full_steps
        record["full_minutes"] = round((seconds + (full_steps - record["steps"]) * per_step) / 60, 1)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--full_steps", type=int, help="the recipe's full step count, for the projection")
    parser.add_argument("mae_args", nargs=argparse.REMAINDER, help="-- STAGE OPTIONS... (--output_dir kept if given)")
    args = parser.parse_args()
    argv = [a for a in args.mae_args if a != "--"]
    record = measure(argv, args.full_steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
