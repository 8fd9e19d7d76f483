"""The one training loop. Pretraining, probing and fine-tuning differ only in their task.

A task provides `model`, `forward(batch) -> {"loss": tensor, ...}` and, optionally,
`evaluate(epoch, final) -> dict | None`; the loop owns everything else: accumulation, precision,
the lr schedule, clipping, non-finite steps, logging, checkpoints, resume and graceful stops.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from mae.config import LoopConfig
from mae.run_folder import checkpoint_dir
from mae.train.checkpoint import save_checkpoint
from mae.train.metrics import MetricsWriter, report_bad_files
from mae.train.schedule import apply_lr, lr_at


class Task(Protocol):
    model: torch.nn.Module

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]: ...

    def after_step(self) -> None: ...

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any] | None: ...


class TrainingError(RuntimeError):
    """A run that cannot go on; the message says why and what to do."""


@dataclass
class LoopState:
    """Where the loop is; saved in every checkpoint as loop_state.json."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch in progress
    batch_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    nonfinite_steps: int = 0  # micro-steps skipped for a non-finite loss, in total
    bad_files: list[str] = field(default_factory=list)  # files that failed to decode (as of the last log line)


@dataclass(frozen=True)
class Schedule:
    base_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int


class _StopRequest:
    """SIGTERM/SIGINT set a flag read at the next step boundary; a second signal exits at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = True


def fit(
    task: Task,
    *,
    accelerator: Accelerator,
    loader: torch.utils.data.DataLoader,
    sampler: Any,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    loop: LoopConfig,
    output_dir: Path,
    config_yaml: str,
    state: LoopState,
    clip_grad: float | None = None,
) -> LoopState:
    """Train `task` until `loop.epochs`; returns the final `LoopState`."""
    metrics = MetricsWriter(accelerator, output_dir)
    steps_per_epoch = math.ceil(len(loader) / accelerator.gradient_accumulation_steps)
    bar = tqdm(
        total=schedule.total_steps,
        initial=state.step,
        disable=not (loop.progress and accelerator.is_main_process),
        dynamic_ncols=True,
        desc="train",
    )
    window = _Window(accelerator)
    nonfinite_run = 0

    def checkpoint() -> None:
        try:
            save_checkpoint(accelerator, output_dir, state.step, asdict(state), config_yaml, loop.keep_checkpoints)
        except OSError as e:
            raise TrainingError(
                f"could not save a checkpoint in {output_dir / 'checkpoints'} ({e.strerror or e}); the earlier "
                "checkpoints there are complete: free some space, then run the same command to resume"
            ) from None

    with _StopRequest() as stop:
        while state.epoch < loop.epochs:
            batches = accelerator.skip_first_batches(loader, state.batch_in_epoch) if state.batch_in_epoch else loader
            # Accelerate's loader re-sets its sampler's epoch from its own counter on every pass;
            # give both ours, which is the truth after a resume.
            batches.set_epoch(state.epoch)
            sampler.set_epoch(state.epoch)
            for batch in batches:
                state.batch_in_epoch += 1
                window.bad.extend(batch.get("bad", []))
                with accelerator.accumulate(task.model):
                    loss = task.forward(batch)["loss"] if batch.get("image", 0) is not None else None
                    if loss is not None and _all_finite(accelerator, loss):
                        accelerator.backward(loss)
                        window.add(loss, len(batch["image"]))
                        nonfinite_run = 0
                    elif loss is not None:
                        state.nonfinite_steps += 1
                        nonfinite_run += 1
                        if nonfinite_run >= loop.max_nonfinite_steps:
                            raise TrainingError(
                                f"{nonfinite_run} non-finite losses in a row at step {state.step}; the last good "
                                f"checkpoint is kept in {output_dir}/checkpoints. Lower --optim.blr, set "
                                "--optim.clip_grad, or try --loop.mixed_precision no"
                            )
                    if accelerator.sync_gradients:
                        lr = lr_at(
                            state.step,
                            base_lr=schedule.base_lr,
                            total_steps=schedule.total_steps,
                            warmup_steps=schedule.warmup_steps,
                            min_lr=schedule.min_lr,
                        )
                        apply_lr(optimizer, lr)
                        if clip_grad:
                            accelerator.clip_grad_norm_(task.model.parameters(), clip_grad)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        task.after_step()
                        state.step += 1
                        bar.update(1)
                        if state.step % loop.log_every == 0 or state.step == schedule.total_steps:
                            record = window.flush(state, lr, steps_per_epoch)
                            if len({g.get("lr_scale", 1.0) for g in optimizer.param_groups}) > 1:
                                record["group_lrs"] = [g["lr"] for g in optimizer.param_groups]
                            metrics.write(record)
                            bar.set_postfix(
                                loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", img_s=f"{record['img_per_s']:.1f}"
                            )
                        if state.step % loop.checkpoint_every == 0:
                            checkpoint()
                        if _any(accelerator, stop.requested):
                            checkpoint()
                            accelerator.print(
                                f"\nstopped by signal at step {state.step}; checkpoint saved. "
                                "Run the same command again to resume."
                            )
                            bar.close()
                            raise SystemExit(0)
            state.epoch += 1
            state.batch_in_epoch = 0
            final = state.epoch == loop.epochs
            if final or (loop.eval_every and state.epoch % loop.eval_every == 0):
                result = task.evaluate(state.epoch, final)
                if result:
                    metrics.write({"step": state.step, "epoch": state.epoch, **result})
                    if accelerator.is_main_process:
                        tqdm.write(_eval_line(state.epoch, loop.epochs, result))
        bar.close()
        if not checkpoint_dir(output_dir, state.step).exists():
            checkpoint()
    return state


def _eval_line(epoch: int, epochs: int, result: dict[str, Any]) -> str:
    """An evaluation for the console: "epoch 3/10: val loss 0.4123, top1 87.20%, top5 99.10% (600 images)"."""
    parts = [f"{result.get('eval', 'eval')} loss {result['loss']:.4f}"]
    for key in ("top1", "top5", "knn_top1", "knn_top5"):
        if key in result:
            parts.append(f"{key.replace('_', ' ')} {result[key]:.2f}%")
    extra = f" ({result['samples']} images)" if "samples" in result else ""
    if "preview" in result:
        extra = f" ({result['preview']})"
    return f"epoch {epoch}/{epochs}: " + ", ".join(parts) + extra


class _Window:
    """Loss and throughput since the last log line, reduced over processes only when logged."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        self.loss_sum = torch.zeros((), device=accelerator.device)
        self.count = 0
        self.images = 0
        self.bad: list[tuple[str, str]] = []  # (file, reason) met on this process since the last flush
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, images: int) -> None:
        self.loss_sum += loss.detach().float()
        self.count += 1
        self.images += images

    def flush(self, state: LoopState, lr: float, steps_per_epoch: int) -> dict[str, Any]:
        acc = self.accelerator
        loss = acc.reduce(self.loss_sum / max(1, self.count), "mean").item() if self.count else float("nan")
        images = _total(acc, self.images)
        report_bad_files(acc, self.bad, state.bad_files)
        elapsed = time.perf_counter() - self.start
        record = {
            "step": state.step,
            "epoch": round(state.epoch + state.batch_in_epoch / (steps_per_epoch * acc.gradient_accumulation_steps), 4),
            "loss": loss,
            "lr": lr,
            "img_per_s": images / elapsed if elapsed > 0 else 0.0,
            "nonfinite_steps": state.nonfinite_steps,
            "skipped_files": len(state.bad_files),
        }
        self.loss_sum.zero_()
        self.count = self.images = 0
        self.bad = []
        self.start = time.perf_counter()
        return record


def _total(accelerator: Accelerator, value: int) -> int:
    """Sum a per-process count over processes."""
    if accelerator.num_processes == 1:
        return int(value)
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "sum").item())


def _all_finite(accelerator: Accelerator, loss: torch.Tensor) -> bool:
    """Every process must agree to skip, or DDP's all-reduce in backward would hang."""
    ok = torch.isfinite(loss.detach()).float()
    if accelerator.num_processes > 1:
        ok = accelerator.reduce(ok, "min")
    return bool(ok.item())


def _any(accelerator: Accelerator, flag: bool) -> bool:
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "max").item())
