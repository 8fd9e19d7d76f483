"""What every training stage does around `fit`: optimizer, speed settings, `prepare`, config.yaml, resume,
trackers, the start line. A stage hands over its model, data, optimizer and task; `train` does the rest."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator

from mae.config import flatten
from mae.models.spec import ModelSpec, with_spec
from mae.run_folder import CONFIG, METRICS
from mae.train.accelerator import describe_precision, plain_model, warn
from mae.train.checkpoint import check_disk_space, config_record, load_loop_state
from mae.train.loaders import prepare_eval, prepare_training
from mae.train.loop import LoopState, fit
from mae.train.metrics import MetricsWriter
from mae.train.optim import Schedule, base_lr, effective_batch
from mae.train.speed import configure_speed, maybe_compile


def train(
    cfg: Any,
    *,
    accelerator: Accelerator,
    model: torch.nn.Module,
    dataset: torch.utils.data.Dataset,
    collate_fn: Callable,
    num_workers: int,
    optimizer: Callable[[torch.nn.Module, float], torch.optim.Optimizer],
    task: Callable[[torch.nn.Module, Any], Any],
    title: str,
    resume_from: Path | None,
    val_loader: torch.utils.data.DataLoader | None = None,
    preamble: list[dict[str, Any]] | None = None,
    spec: ModelSpec | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Train `model` per `cfg` (`loop`, `optim`, `output_dir`, `seed`): `optimizer(model, lr)` builds its
    optimizer, `task(model, val_loader)` its task (both prepared); `title` heads the start line; `preamble` are
    metrics lines written first on a fresh start (e.g. the fine-tune's starting probe); `spec`, the model's record,
    goes into every checkpoint's config.yaml. Returns the trained model as
    prepared, and the task."""
    lr = base_lr(cfg, accelerator.num_processes)
    opt = optimizer(model, lr)
    configure_speed(model, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    model, opt, loader = prepare_training(cfg, accelerator, model, opt, dataset, collate_fn, num_workers)
    val = prepare_eval(accelerator, val_loader) if val_loader is not None else None
    model = maybe_compile(model, cfg.loop.compile, accelerator.device.type)
    the_task = task(model, val)
    steps_per_epoch = math.ceil(len(loader) / cfg.loop.accum_steps)
    epochs = max(cfg.loop.epochs, math.ceil(cfg.loop.min_steps / steps_per_epoch))  # the step budget's epochs
    # The warm-up is a share of the run (warmup_epochs of loop.epochs): a run that min_steps grows warms up longer.
    warmup_share = cfg.optim.warmup_epochs / cfg.loop.epochs
    schedule = Schedule(
        base_lr=lr,
        min_lr=cfg.optim.min_lr,
        total_steps=epochs * steps_per_epoch,
        warmup_steps=round(warmup_share * epochs * steps_per_epoch),
    )
    check_disk_space(Path(cfg.output_dir), plain_model(accelerator, model), opt, cfg.loop.keep_checkpoints)
    config_yaml = yaml.safe_dump(with_spec(config_record(cfg), spec), sort_keys=False)
    state = _start(cfg, accelerator, loader, config_yaml, resume_from)
    if resume_from is None:
        for record in preamble or []:
            MetricsWriter(accelerator, cfg.output_dir).write(record)
    _announce(cfg, accelerator, schedule, steps_per_epoch, title)
    fit(
        the_task,
        accelerator=accelerator,
        loader=loader,
        optimizer=opt,
        schedule=schedule,
        loop=replace(cfg.loop, epochs=epochs),
        output_dir=Path(cfg.output_dir),
        config_yaml=config_yaml,
        state=state,
        clip_grad=getattr(cfg.optim, "clip_grad", None),
    )
    return model, the_task


def _start(cfg: Any, accelerator: Accelerator, loader: Any, config_yaml: str, resume_from: Path | None) -> LoopState:
    """Write config.yaml; restore the checkpoint to resume from (or clear an old run's metrics); start the
    trackers. Returns where the loop starts."""
    output_dir = Path(cfg.output_dir)
    state = LoopState()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / CONFIG).write_text(config_yaml)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = LoopState(**load_loop_state(resume_from))
        loader.restore(resume_from, accelerator.process_index)
        accelerator.print(f"resuming from {resume_from} (step {state.step}, epoch {state.epoch})")
    elif accelerator.is_main_process and (output_dir / METRICS).exists():
        (output_dir / METRICS).unlink()  # a fresh start: the old run's log would mislead
    MetricsWriter(accelerator, output_dir).truncate_after(state.step)
    if accelerator.log_with:
        accelerator.init_trackers("mae", config=flatten(config_record(cfg)))
    return state


def _announce(cfg: Any, accelerator: Accelerator, schedule: Schedule, steps_per_epoch: int, title: str) -> None:
    """The start line, and a warning when the warm-up is as long as the run."""
    precision = describe_precision(cfg.loop.mixed_precision, accelerator.mixed_precision)
    peak, lr = schedule.peak, schedule.base_lr
    accelerator.print(
        f"{title}: effective batch {effective_batch(cfg, accelerator.num_processes)}, peak lr {peak:.3g} "
        f"(blr {cfg.optim.blr:g}), {steps_per_epoch} steps/epoch, {schedule.total_steps} steps, precision "
        f"{precision}, {accelerator.num_processes} process(es)"
    )
    epochs = schedule.total_steps // max(1, steps_per_epoch)
    if epochs > cfg.loop.epochs:
        accelerator.print(
            f"--loop.min_steps {cfg.loop.min_steps}: {epochs} epochs of {steps_per_epoch} steps, warm-up "
            f"{schedule.warmup_steps} steps (the share of the run that --optim.warmup_epochs is of --loop.epochs)"
        )
    if cfg.optim.warmup_epochs >= epochs:
        warn(
            accelerator,
            f"--optim.warmup_epochs {cfg.optim.warmup_epochs:g} is not shorter than the run ({epochs} epochs): the "
            f"lr only rises to {peak:.3g}, {peak / lr:.0%} of the {lr:.3g} it warms up to, and never decays; set a "
            f"warm-up that is a fraction of the run (e.g. --optim.warmup_epochs {epochs / 10:g})",
        )
