"""What the training loop keeps and counts: where it is (`LoopState`, saved in every checkpoint), the steps skipped
for non-finite gradients, the window of losses and throughput between log lines, and the loader's pace."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from mae.train.metrics import report_bad_files


@dataclass
class LoopState:
    """Where the loop is; saved in every checkpoint as loop_state.json."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch in progress
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    nonfinite_steps: int = 0  # optimizer steps skipped for non-finite gradients (a non-finite loss), in total
    bad_files: list[str] = field(default_factory=list)  # files that failed to decode (as of the last log line)
    rerun_batches: int = 0  # batches with no readable image, rerun from the previous one for no gradient (in total)


class Skips:
    """Steps with non-finite gradients (a non-finite loss makes them so) are skipped and counted on the
    device, as a gradient scaler does, and read only at log lines and checkpoints: no host sync per step.

    The decision uses the global gradient norm, which every process computes from the same all-reduced
    gradients, so all processes skip the same steps without a collective of their own. Optimizers with
    a fused kernel (the AdamW of pretraining and fine-tuning, fused SGD) skip the update on the device
    (`found_inf`, what torch's GradScaler hands them); others are stepped after reading the flag.
    """

    def __init__(self, accelerator: Accelerator, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        inner = getattr(optimizer, "optimizer", optimizer)  # under Accelerate's wrapper
        self.fused = bool(inner.defaults.get("fused"))
        self.inner = inner
        self.skipped = torch.zeros((), device=accelerator.device)  # since the last read
        self.run = torch.zeros((), device=accelerator.device)  # skipped steps in a row

    def step(self, grad_norm: torch.Tensor | None) -> None:
        """The optimizer step, unless `grad_norm` (the global gradient norm) is not finite."""
        if grad_norm is None:  # an engine that clips and skips by itself (DeepSpeed)
            self.optimizer.step()
            return
        found_inf = (~torch.isfinite(grad_norm.detach())).float().reshape(())
        self.skipped += found_inf
        self.run = (self.run + found_inf) * found_inf
        if self.fused:
            self.inner.found_inf = found_inf  # read by the fused kernel, which leaves params and state as they were
            self.optimizer.step()
            self.inner.found_inf = None
        elif not found_inf.item():
            self.optimizer.step()

    def collect(self, state: LoopState) -> int:
        """Add the skipped steps to `state`; returns the current run of skipped steps."""
        skipped, run = torch.stack([self.skipped, self.run]).tolist()
        state.nonfinite_steps += int(skipped)
        self.skipped.zero_()
        return int(run)


class Window:
    """Loss and throughput since the last log line, reduced over processes only when logged; non-finite
    losses are left out of the mean, on the device."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.count = torch.zeros((), device=accelerator.device)
        self.images = 0
        self.reruns = 0  # batches of this process rerun for no gradient since the last flush
        self.wait = 0.0  # seconds spent waiting for batches
        self.bad: list[tuple[str, str]] = []  # (file, reason) met on this process since the last flush
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self.count += finite.float()
        self.images += images

    def flush(self, state: LoopState, lr: float, steps_per_epoch: int) -> dict[str, Any]:
        acc = self.accelerator
        # the mean over every process's finite losses (a process that only reran a batch has none); 0 / 0 when no
        # process has one: NaN, logged as null
        loss_sum, count = acc.reduce(torch.stack([self.loss_sum, self.count]), "sum")
        loss = (loss_sum / count).item()
        images, reruns = totals(acc, self.images, self.reruns)
        state.rerun_batches += reruns
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
            "rerun_batches": state.rerun_batches,
            "data_wait": round(wait, 4),
        }
        self.wait = 0.0
        self.loss_sum.zero_()
        self.count.zero_()
        self.images = 0
        self.reruns = 0
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


def total(accelerator: Accelerator, value: int) -> int:
    """Sum a per-process count over processes."""
    if accelerator.num_processes == 1:
        return int(value)
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "sum").item())


def totals(accelerator: Accelerator, *values: int) -> list[int]:
    """Sum several per-process counts over processes, in one collective."""
    if accelerator.num_processes == 1:
        return [int(v) for v in values]
    summed = accelerator.reduce(torch.tensor(values, device=accelerator.device), "sum")
    return [int(v) for v in summed.tolist()]
