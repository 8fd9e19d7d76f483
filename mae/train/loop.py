"""The one training loop. Pretraining, probing and fine-tuning differ only in their task.

A task provides `model`, `forward(batch) -> {"loss": tensor, ...}` and, optionally,
`evaluate(epoch, final) -> dict | None`; the loop owns everything else: accumulation, precision,
the lr schedule, clipping, non-finite steps, logging, checkpoints, resume and graceful stops.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from mae.config import LoopConfig
from mae.errors import TrainingError
from mae.run_folder import checkpoint_dir
from mae.train.checkpoint import save_checkpoint
from mae.train.loop_state import LoaderDoctor, LoopState, Skips, Window, total
from mae.train.metrics import MetricsWriter, report_bad_files
from mae.train.optim import Schedule, apply_lr


class Task(Protocol):
    """What differs between stages (`mae.train.tasks`): the model, its loss on a batch, an evaluation."""

    model: torch.nn.Module

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]: ...

    def after_step(self) -> None: ...

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any] | None: ...


class TrainingLoader(Protocol):
    """What the loop reads its batches from (`mae.train.loaders`): one epoch's batches from any position, the
    position itself for a checkpoint (a stream's, per process), and its worker count (for the pace warning)."""

    num_workers: int

    def __len__(self) -> int: ...

    def epoch_batches(self, epoch: int, skip: int) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...


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
    loader: TrainingLoader,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    loop: LoopConfig,
    output_dir: Path,
    config_yaml: str,
    state: LoopState,
    clip_grad: float | None = None,
) -> LoopState:
    """Train `task` until `loop.epochs`; returns the final `LoopState`. `loader` is a training loader
    (`mae.train.loaders`: `len`, `epoch_batches(epoch, skip)`, `state_dict()`, `num_workers`)."""
    run = _Run(task, accelerator, loader, optimizer, schedule, loop, output_dir, config_yaml, state, clip_grad)
    with _StopRequest() as stop:
        while state.epoch < loop.epochs:
            run.epoch(stop)
        run.bar.close()
        if not checkpoint_dir(output_dir, state.step).exists():
            run.checkpoint()
    return state


class _Run:
    """One call of `fit`: the epoch, the step, logging and checkpoints, over the state they share."""

    def __init__(self, task, accelerator, loader, optimizer, schedule, loop, output_dir, config_yaml, state, clip):
        self.task, self.accelerator, self.loader, self.optimizer = task, accelerator, loader, optimizer
        self.schedule, self.loop, self.output_dir, self.config_yaml = schedule, loop, output_dir, config_yaml
        self.state, self.clip_grad = state, clip or math.inf
        self.metrics = MetricsWriter(accelerator, output_dir)
        self.steps_per_epoch = math.ceil(len(loader) / accelerator.gradient_accumulation_steps)
        self.bar = tqdm(
            total=schedule.total_steps,
            initial=state.step,
            disable=not (loop.progress and accelerator.is_main_process),
            dynamic_ncols=True,
            desc="train",
        )
        self.window = Window(accelerator)
        self.skips = Skips(accelerator, optimizer)
        # One process checks its own stop flag every step (no collective); several agree on it at log steps.
        self.stop_every = 1 if accelerator.num_processes == 1 else loop.log_every
        self.first_step: float | None = time.perf_counter()
        self.doctor = LoaderDoctor(accelerator, loader)
        self.last_readable: dict[str, Any] | None = None  # stands in for a batch of unreadable files

    def epoch(self, stop: _StopRequest) -> None:
        """The rest of the current epoch, then its evaluation."""
        state, acc = self.state, self.accelerator
        batches = self.loader.epoch_batches(state.epoch, state.batch_in_epoch)
        waiting = time.perf_counter()
        batches_read, images_read = 0, 0  # in this pass over the epoch, on this process
        for batch in batches:
            self.window.wait += time.perf_counter() - waiting
            state.batch_in_epoch += 1
            batches_read += 1
            images_read += self.micro_step(batch)
            if acc.sync_gradients:
                self.optimizer_step(stop)
            waiting = time.perf_counter()
        # skipping files must not train on nothing (every process takes part in both sums)
        if total(acc, images_read) == 0 and total(acc, batches_read) > 0:
            report_bad_files(acc, self.window.bad, state.bad_files)
            raise TrainingError(
                f"no image of epoch {state.epoch + 1} could be read: every file was skipped as unreadable "
                f"({len(state.bad_files)} warned above, e.g. {state.bad_files[0] if state.bad_files else '?'}); "
                "check --data.path (and --data.image_column)"
            )
        state.epoch += 1
        state.batch_in_epoch = 0
        self.doctor.epoch_end()
        self.evaluate()

    def micro_step(self, batch: dict[str, Any]) -> int:
        """Forward and backward of one batch (gradients accumulate); returns the images it trained on."""
        acc = self.accelerator
        self.window.bad.extend(batch.get("bad", []))
        readable = batch.get("image", 0) is not None
        if not readable and acc.num_processes > 1:
            # every process must take part in the step's collectives: run a batch seen before, for no gradient
            if self.last_readable is None:
                raise TrainingError(
                    f"process {acc.process_index} could read none of the images of its first batch, so it cannot "
                    "take part in the step (the others wait on it); fix or remove the unreadable files warned above"
                )
            batch = self.last_readable
            self.window.reruns += 1
        with acc.accumulate(self.task.model):
            if readable or acc.num_processes > 1:
                loss = self.task.forward(batch)["loss"]
                # a non-finite loss makes non-finite gradients: skipped in `optimizer_step`
                acc.backward(loss if readable else loss * 0.0)
            if not readable:
                return 0
            self.window.add(loss, len(batch["image"]))
            self.last_readable = batch
            return len(batch["image"])

    def optimizer_step(self, stop: _StopRequest) -> None:
        """The update at the end of an accumulation, then logging, checkpoints and stop requests."""
        state, acc = self.state, self.accelerator
        lr = self.schedule.lr(state.step)
        apply_lr(self.optimizer, lr)
        self.skips.step(acc.clip_grad_norm_(self.task.model.parameters(), self.clip_grad))
        self.optimizer.zero_grad(set_to_none=True)
        self.task.after_step()
        state.step += 1
        self.bar.update(1)
        if self.first_step is not None:
            _report_first_step(acc, self.task.model, time.perf_counter() - self.first_step)
            self.first_step = None
        if state.step % self.loop.log_every == 0 or state.step == self.schedule.total_steps:
            self.log(lr)
        if state.step % self.loop.checkpoint_every == 0:
            self.checkpoint()
        if state.step % self.stop_every == 0 and self.stop_agreed(stop):
            self.checkpoint()
            acc.print(
                f"\nstopped by signal at step {state.step}; checkpoint saved. Run the same command again to resume."
            )
            self.bar.close()
            raise SystemExit(0)

    def stop_agreed(self, stop: _StopRequest) -> bool:
        """Whether to stop now: one process reads its own flag; several agree through Accelerate's trigger, which
        any process may raise and all read together (a collective: every process calls this at the same steps)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return stop.requested
        if stop.requested:
            acc.set_trigger()
        return acc.check_trigger()

    def log(self, lr: float) -> None:
        """A metrics line (and the end of a run of non-finite steps too long to go on)."""
        state = self.state
        run = self.skips.collect(state)
        if run >= self.loop.max_nonfinite_steps:
            raise TrainingError(
                f"{run} non-finite losses in a row at step {state.step}; the last good checkpoint is kept in "
                f"{self.output_dir}/checkpoints. Lower --optim.blr, set --optim.clip_grad, or try "
                "--loop.mixed_precision no"
            )
        record = self.window.flush(state, lr, self.steps_per_epoch)
        if len({g.get("lr_scale", 1.0) for g in self.optimizer.param_groups}) > 1:
            record["group_lrs"] = [g["lr"] for g in self.optimizer.param_groups]
        self.metrics.write(record)
        self.doctor.check(record["data_wait"])
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", img_s=f"{record['img_per_s']:.1f}")

    def evaluate(self) -> None:
        """The task's evaluation, when one is due after the epoch just finished."""
        state, loop = self.state, self.loop
        final = state.epoch == loop.epochs
        if not (final or (loop.eval_every and state.epoch % loop.eval_every == 0)):
            return
        result = self.task.evaluate(state.epoch, final)
        if result:
            self.metrics.write({"step": state.step, "epoch": state.epoch, **result})
            if self.accelerator.is_main_process:
                tqdm.write(_eval_line(state.epoch, loop.epochs, result))

    def checkpoint(self) -> None:
        self.skips.collect(self.state)
        try:
            save_checkpoint(
                self.accelerator,
                self.output_dir,
                self.state.step,
                asdict(self.state),
                self.config_yaml,
                self.loop.keep_checkpoints,
                process_state=self.loader.state_dict(),
            )
        except OSError as e:
            raise TrainingError(
                f"could not save a checkpoint in {self.output_dir / 'checkpoints'} ({e.strerror or e}); the "
                "earlier checkpoints there are complete: free some space, then run the same command to resume"
            ) from None


def _report_first_step(accelerator: Accelerator, model: torch.nn.Module, seconds: float) -> None:
    """The first step's time, which holds torch.compile's compilation when the model is compiled."""
    if hasattr(model, "_orig_mod"):  # torch.compile's wrapper
        accelerator.print(f"first step (torch.compile compiling) took {seconds:.1f} s")


def _eval_line(epoch: int, epochs: int, result: dict[str, Any]) -> str:
    """An evaluation for the console: "epoch 3/10: val loss 0.4123, top1 87.20%, top5 99.10% (600 images)"."""
    parts = [f"{result.get('eval', 'eval')} loss {result['loss']:.4f}"]
    for key in ("top1", "top5", "knn_top1", "knn_top5", "miou", "pixel_acc"):
        if key in result:
            parts.append(f"{key.replace('_', ' ')} {result[key]:.2f}%")
    extra = f" ({result['samples']} images)" if "samples" in result else ""
    if "preview" in result:
        extra = f" ({result['preview']})"
    return f"epoch {epoch}/{epochs}: " + ", ".join(parts) + extra
