"""metrics.jsonl (one JSON object per logged step or evaluation) plus Accelerate's trackers; the window of
training steps a metrics line sums up (`LogWindow`), and the warning when the loader cannot keep up
(`LoaderDoctor`)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from mae.run_folder import METRICS


class MetricsWriter:
    """Appends to `output_dir/metrics.jsonl` on the main process and forwards to the trackers."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path) -> None:
        self.accelerator = accelerator
        self.path = Path(output_dir) / METRICS

    def write(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.trackers:
            self.accelerator.log(numbers, step=record.get("step"))

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint, so the file reads as one run."""
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))


def report_bad_files(accelerator: Accelerator, pending: list[tuple[str, str]], seen: list[str]) -> None:
    """Warn once per file that failed to decode (on the main process, whatever process or worker met
    it) and add it to `seen`; every process calls this together."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        pending = gather_object(pending)
    known = set(seen)
    for name, reason in pending:
        if name not in known:
            known.add(name)
            seen.append(name)
            if accelerator.is_main_process:
                warnings.warn(f"skipping unreadable image {name}: {reason}", stacklevel=2)


class LogWindow:
    """Loss and throughput since the last log line, reduced over processes only when logged; non-finite
    losses are left out of the mean, on the device."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.count = torch.zeros((), device=accelerator.device)
        self.images = 0
        self.wait = 0.0  # seconds spent waiting for batches
        self.bad: list[tuple[str, str]] = []  # (file, reason) met on this process since the last flush
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self.count += finite.float()
        self.images += images

    def flush(self, state: Any, lr: float, steps_per_epoch: int) -> dict[str, Any]:
        """The metrics line of the window (`state`: the loop's `LoopState`), and a fresh window."""
        acc = self.accelerator
        loss = acc.reduce(self.loss_sum / self.count, "mean").item()  # 0 / 0: NaN, logged as null
        images = sum_over_processes(acc, self.images)
        report_bad_files(acc, self.bad, state.bad_files)
        elapsed = time.perf_counter() - self.start
        wait = self.wait / elapsed if elapsed > 0 else 0.0
        if acc.num_processes > 1:  # the slowest loader sets the pace
            wait = acc.reduce(torch.tensor(wait, device=acc.device), "max").item()
        record = {
            "step": state.step,
            "epoch": round(state.epoch + state.batch_in_epoch / (steps_per_epoch * acc.gradient_accumulation_steps), 4),
            "loss": loss,
            "lr": lr,
            "img_per_s": images / elapsed if elapsed > 0 else 0.0,
            "nonfinite_steps": state.nonfinite_steps,
            "skipped_files": len(state.bad_files),
            "data_wait": round(wait, 4),
        }
        self.wait = 0.0
        self.loss_sum.zero_()
        self.count.zero_()
        self.images = 0
        self.bad = []
        self.start = time.perf_counter()
        return record


class LoaderDoctor:
    """Warns once when the step waits for its batch more than `LIMIT` of the time (`data_wait` in the
    metrics). Neither the first log window (workers starting) nor the run's first `SETTLE` seconds are
    judged: a short run or a start-up hiccup is not a loader problem. Nor is the process's first epoch
    while it is shorter than `FIRST_EPOCH` seconds: it fills the caches (images decoded once per process,
    the page cache, downloaded shards) that later epochs read; a long first epoch is judged after that."""

    LIMIT = 0.2
    SETTLE = 60.0
    FIRST_EPOCH = 300.0

    def __init__(self, accelerator: Accelerator, loader: Any) -> None:
        self.accelerator, self.loader = accelerator, loader
        self.windows = 0
        self.epochs = 0  # epochs this process has finished
        self.warned = False
        self.start = time.perf_counter()

    def epoch_end(self) -> None:
        self.epochs += 1

    def check(self, data_wait: float) -> None:
        self.windows += 1
        elapsed = time.perf_counter() - self.start
        settled = self.windows >= 2 and elapsed >= self.SETTLE and (self.epochs or elapsed >= self.FIRST_EPOCH)
        if self.warned or not settled or data_wait <= self.LIMIT:
            return
        self.warned = True
        workers = getattr(self.loader, "num_workers", 0)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        procs = self.accelerator.num_processes
        hint = (
            f"raise --data.num_workers (now {workers} per process, {procs} process(es) on {cores} cores)"
            if workers * procs < (cores or 1)
            else "every core already loads data"
        )
        if self.accelerator.is_main_process:
            tqdm.write(
                f"warning: data_wait {data_wait:.0%}: the training step waited for its batch {data_wait:.0%} of "
                f"the time; {hint}; for large photos, pre-resize them once (mae shard SOURCE --output DIR "
                "--max_size 768) and train from the shards",
                file=sys.stderr,
            )


def sum_over_processes(accelerator: Accelerator, value: int) -> int:
    """Sum a per-process count over processes."""
    if accelerator.num_processes == 1:
        return int(value)
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "sum").item())
