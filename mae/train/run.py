"""What every training stage does around `fit`: the Accelerator, loaders, resume, config.yaml, trackers."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed

from mae.config import ConfigError, flatten, to_dict
from mae.data.samplers import EpochSampler
from mae.data.streaming import StreamSamples, StreamSource
from mae.run_folder import CONFIG, METRICS, list_checkpoints
from mae.train.checkpoint import checkpoint_bytes, load_loop_state, load_process_state
from mae.train.loop import LoopState, Schedule, fit
from mae.train.metrics import MetricsWriter
from mae.train.schedule import lr_at
from mae.train.stream_loaders import StreamLoader


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: a CPU that computes in bf16 at all (elsewhere bf16 is emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16_PAYS = 1.25  # bf16 must run matrix products this much faster than fp32 for `auto` to take it


@functools.cache
def cpu_bf16_speedup(n: int = 1024, repeats: int = 5) -> float:
    """How much faster this CPU multiplies n x n matrices in bf16 than in fp32 (~0.2 s, once per process).

    Timed rather than read off the flags: with AVX512-BF16 and no AMX an AMD EPYC ran bf16 2.2x faster
    than fp32 and an Intel Xeon (AMX not exposed to the VM) 0.5x, so the flags cannot tell the two apart.
    Both warmed up twice, then timed in turns (best of `repeats` each) so a slow start hits neither alone.
    """
    if not cpu_has_bf16():
        return 0.0
    mats = {dtype: torch.randn(n, n).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
    for a in (*mats.values(), *mats.values()):
        a @ a  # warm-up: threads wake, oneDNN picks and caches its kernel
    best = dict.fromkeys(mats, math.inf)
    for _ in range(repeats):
        for dtype, a in mats.items():
            t = time.perf_counter()
            a @ a
            best[dtype] = min(best[dtype], time.perf_counter() - t)
    return best[torch.float32] / best[torch.bfloat16]


def resolve_precision(choice: str) -> str:
    """`auto`: bf16 on GPUs that have it (else fp16); on a CPU bf16 only where it was timed to pay."""
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if agreed_bf16_speedup() >= BF16_PAYS else "no"


@functools.cache
def agreed_bf16_speedup() -> float:
    """`cpu_bf16_speedup`, the lowest over all processes of a multi-process CPU run, so that every rank takes
    the same precision (each times its own cores). Starts the process group the Accelerator then joins."""
    speedup = cpu_bf16_speedup()
    if not _multi_process_cpu():
        return speedup
    PartialState(cpu=True)
    lowest = torch.tensor([speedup], dtype=torch.float64)
    torch.distributed.all_reduce(lowest, op=torch.distributed.ReduceOp.MIN)
    return lowest.item()


def describe_precision(choice: str, resolved: str) -> str:
    """The precision for the start line; on a CPU under `auto`, with the timing that chose it."""
    if choice != "auto" or torch.cuda.is_available() or not cpu_has_bf16():
        return resolved
    return f"{resolved} (auto: bf16 matrix products {agreed_bf16_speedup():.2f}x fp32 on this CPU)"


def resolve_tracker(choice: str) -> str | None:
    if choice == "auto":
        found = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return "tensorboard" if found else None
    return None if choice == "none" else choice


def _multi_process_cpu() -> bool:
    """torchrun / accelerate launch without GPUs: Accelerate needs cpu=True to use gloo."""
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_output_dir(cfg: Any) -> None:
    """The output folder can be created and written (tried, not guessed from permission bits)."""
    out = Path(cfg.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # A name of its own: processes that start together on one folder must not delete each other's probe.
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)
        os.write(fd, b"ok")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"--output_dir {cfg.output_dir}: cannot write there ({e.strerror or e}); choose a folder you can write to"
        ) from None
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint; use auto, never or a checkpoint folder")


def find_resume_checkpoint(cfg: Any) -> Path | None:
    """The checkpoint to continue from, after checking it ran the same config (epochs aside)."""
    if cfg.resume == "never":
        return None
    found = list_checkpoints(cfg.output_dir)[-1:] if cfg.resume == "auto" else [Path(cfg.resume)]
    if not found:
        return None
    ckpt = found[0]
    saved = flatten(yaml.safe_load((ckpt / CONFIG).read_text()))
    current = flatten(to_dict(cfg))
    ignore = {"loop.epochs", "resume", "output_dir"}
    changed = sorted(k for k in set(saved) | set(current) if k not in ignore and saved.get(k) != current.get(k))
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ConfigError(
            f"--resume {cfg.resume}: {ckpt} was trained with a different config ({diffs}); "
            "restore those options, or pass --resume never (or a new --output_dir) to start over"
        )
    return ckpt


def check_disk_space(output_dir: Path, model: torch.nn.Module, optimizer: Any, keep: int) -> None:
    """Refuse to start when the kept checkpoints, plus the one being written, cannot fit."""
    import shutil

    need = checkpoint_bytes(model, optimizer) * (keep + 1)
    free = shutil.disk_usage(output_dir).free
    if free < need:
        raise ConfigError(
            f"--output_dir {output_dir}: {free / 2**30:.2f} GiB free, but {keep} checkpoints plus the one being "
            f"written need {need / 2**30:.2f} GiB; free some space, lower --loop.keep_checkpoints, "
            "or pick another folder"
        )


def open_accelerator(cfg: Any) -> Accelerator:
    """The Accelerator for a stage, seeded; `cfg` has `loop`, `output_dir` and `seed`."""
    accelerator = Accelerator(
        mixed_precision=resolve_precision(cfg.loop.mixed_precision),
        gradient_accumulation_steps=cfg.loop.accum_steps,
        log_with=resolve_tracker(cfg.loop.log_with),
        project_dir=str(cfg.output_dir),
        cpu=_multi_process_cpu(),
    )
    set_seed(cfg.seed)
    return accelerator


def make_loader(
    dataset: torch.utils.data.Dataset,
    *,
    batch_size: int,
    collate_fn: Any,
    num_workers: int,
    sampler: Any = None,
    drop_last: bool = True,
    persistent: bool = True,
) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        # the epoch travels with each index, not the dataset (a stream's workers must start afresh instead)
        persistent_workers=persistent and num_workers > 0,
        worker_init_fn=_init_worker,
    )


def _init_worker(worker_id: int) -> None:
    """Workers leave SIGTERM/SIGINT to the training process: a scheduler that signals the whole process
    group must get a checkpoint and a clean exit, not a crash from a dead worker. And they stay quiet
    when the training process is gone (`_quiet_sharer_errors`)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _quiet_sharer_errors


def _quiet_sharer_errors(exc_type, exc, tb) -> None:
    """A worker's thread that hands tensors to the training process fails with a reset connection when that
    process has already stopped (after its own one-line error, e.g. another worker died): no news, and a
    traceback under the error line would read as a second failure. Anything else is printed as usual."""
    frames = traceback.extract_tb(tb)
    if frames and Path(frames[0].filename).name == "resource_sharer.py":
        return
    sys.__excepthook__(exc_type, exc, tb)


def check_batch_fits(n: int, cfg: Any, accelerator: Accelerator) -> None:
    if n < cfg.loop.batch_size * accelerator.num_processes:
        raise ConfigError(
            f"--loop.batch_size {cfg.loop.batch_size}: {n} images cannot fill one batch of "
            f"{cfg.loop.batch_size} x {accelerator.num_processes} processes; lower the batch size"
        )


def effective_lr(cfg: Any, accelerator: Accelerator) -> tuple[float, int]:
    """(absolute lr, effective batch): lr = blr x effective batch / 256 unless --optim.lr is set."""
    eff_batch = cfg.loop.batch_size * cfg.loop.accum_steps * accelerator.num_processes
    lr = cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.blr * eff_batch / 256
    return lr, eff_batch


def train(
    cfg: Any,
    task: Any,
    *,
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    loader: torch.utils.data.DataLoader,
    sampler: Any,
    lr: float,
    what: str,
    resume_from: Path | None,
) -> LoopState:
    """Write config.yaml, restore a checkpoint, start trackers, then `fit` (model, optimizer and
    loader already prepared)."""
    output_dir = Path(cfg.output_dir)
    steps_per_epoch = math.ceil(len(loader) / cfg.loop.accum_steps)
    schedule = Schedule(
        base_lr=lr,
        min_lr=cfg.optim.min_lr,
        total_steps=cfg.loop.epochs * steps_per_epoch,
        warmup_steps=round(cfg.optim.warmup_epochs * steps_per_epoch),
    )
    check_disk_space(output_dir, plain_model(accelerator, task.model), optimizer, cfg.loop.keep_checkpoints)
    config_yaml = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    state = LoopState()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / CONFIG).write_text(config_yaml)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = LoopState(**load_loop_state(resume_from))
        if isinstance(loader, StreamLoader):
            loader.load_state_dict(load_process_state(resume_from, accelerator.process_index))
        accelerator.print(f"resuming from {resume_from} (step {state.step}, epoch {state.epoch})")
    elif accelerator.is_main_process and (output_dir / METRICS).exists():
        (output_dir / METRICS).unlink()  # a fresh start: the old run's log would mislead
    MetricsWriter(accelerator, output_dir).truncate_after(state.step)
    if accelerator.log_with:
        accelerator.init_trackers("mae", config=flatten(to_dict(cfg)))
    eff_batch = cfg.loop.batch_size * cfg.loop.accum_steps * accelerator.num_processes
    peak = peak_lr(schedule)
    precision = describe_precision(cfg.loop.mixed_precision, accelerator.mixed_precision)
    accelerator.print(
        f"{what}: effective batch {eff_batch}, peak lr {peak:.3g} (blr {cfg.optim.blr:g}), "
        f"{steps_per_epoch} steps/epoch, {schedule.total_steps} steps, precision {precision}, "
        f"{accelerator.num_processes} process(es)"
    )
    if cfg.optim.warmup_epochs >= cfg.loop.epochs:
        warn(
            accelerator,
            f"--optim.warmup_epochs {cfg.optim.warmup_epochs:g} is not shorter than the run (--loop.epochs "
            f"{cfg.loop.epochs}): the lr only rises to {peak:.3g}, {peak / lr:.0%} of the {lr:.3g} it warms up to, "
            f"and never decays; set a warm-up that is a fraction of the run (e.g. --optim.warmup_epochs "
            f"{cfg.loop.epochs / 10:g})",
        )
    return fit(
        task,
        accelerator=accelerator,
        loader=loader,
        sampler=sampler,
        optimizer=optimizer,
        schedule=schedule,
        loop=cfg.loop,
        output_dir=output_dir,
        config_yaml=config_yaml,
        state=state,
        clip_grad=getattr(cfg.optim, "clip_grad", None),
    )


def launch(
    cfg: Any,
    *,
    accelerator: Accelerator,
    model: torch.nn.Module,
    dataset: torch.utils.data.Dataset,
    collate_fn: Callable,
    num_workers: int,
    optimizer: Callable[[torch.nn.Module, float], torch.optim.Optimizer],
    task: Callable[[torch.nn.Module, Any], Any],
    what: str,
    resume_from: Path | None,
    val_loader: torch.utils.data.DataLoader | None = None,
) -> tuple[torch.nn.Module, Any]:
    """What every training stage does between its data and its export: sampler, loader, lr, optimizer
    (`optimizer(model, lr)`), attention kernel, `prepare`, compile, the task (`task(model, val_loader)`,
    both prepared), then `fit`. Returns the trained model as prepared, and the task."""
    lr, _ = effective_lr(cfg, accelerator)
    opt = optimizer(model, lr)
    configure_speed(model, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    if isinstance(getattr(dataset, "source", None), StreamSource):  # each process reads its part of the stream
        dataset = StreamSamples(
            dataset.source,
            dataset.prepare,
            seed=cfg.seed,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            in_chans=dataset.in_chans,
        )
        loader = sampler = StreamLoader(
            dataset,
            batch_size=cfg.loop.batch_size,
            collate_fn=collate_fn,
            num_workers=num_workers,
            device=accelerator.device,
        )
        model, opt = accelerator.prepare(model, opt)
    else:
        check_batch_fits(len(dataset), cfg, accelerator)
        sampler, loader = training_loader(cfg, dataset, collate_fn, num_workers)
        model, opt, loader = accelerator.prepare(model, opt, loader)
    val = [prepare_eval(accelerator, val_loader)] if val_loader is not None else []
    model = maybe_compile(model, cfg.loop.compile, accelerator.device.type)
    the_task = task(model, val[0] if val else None)
    train(
        cfg,
        the_task,
        accelerator=accelerator,
        optimizer=opt,
        loader=loader,
        sampler=sampler,
        lr=lr,
        what=what,
        resume_from=resume_from,
    )
    return model, the_task


def prepare_eval(accelerator: Accelerator, loader: Any) -> Any:
    """An evaluation loader, prepared (sharded over processes, gathered exactly by `features.predict`);
    a stream's (`EvalStream`) is split by process already and stays as it is."""
    return loader if getattr(loader, "streamed", False) else accelerator.prepare_data_loader(loader)


def training_loader(
    cfg: Any, dataset: torch.utils.data.Dataset, collate_fn: Callable, num_workers: int
) -> tuple[EpochSampler, torch.utils.data.DataLoader]:
    """The epoch sampler (local reads for a shard set: its `shard_ends`) and the training loader, before
    `prepare` (which shards its batches over processes)."""
    shard_ends = getattr(getattr(dataset, "source", None), "shard_ends", None)
    sampler = EpochSampler(len(dataset), cfg.seed, shard_ends=shard_ends)
    loader = make_loader(
        dataset, batch_size=cfg.loop.batch_size, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers
    )
    return sampler, loader


def peak_lr(schedule: Schedule) -> float:
    """The highest lr the run reaches: the base lr, unless the warm-up outlasts the run."""
    last = min(schedule.warmup_steps, max(0, schedule.total_steps - 1))
    return lr_at(
        last,
        base_lr=schedule.base_lr,
        total_steps=schedule.total_steps,
        warmup_steps=schedule.warmup_steps,
        min_lr=schedule.min_lr,
    )


def warn(accelerator: Accelerator, message: str) -> None:
    """A warning about the run's settings, once (main process), on stderr."""
    if accelerator.is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def configure_speed(model: torch.nn.Module, device_type: str, precision: str, attention: str = "auto") -> None:
    """Choose `model`'s attention kernel (before `prepare`); `precision` is "no", "bf16" or "fp16". On a
    CPU, also keep freed host memory for the next step (`keep_freed_memory`)."""
    if device_type == "cpu":
        keep_freed_memory()
    if attention == "auto":
        attention = "math" if device_type == "cpu" and precision == "bf16" else "fused"
    for module in model.modules():
        if hasattr(module, "fused_attn"):  # timm's Attention
            module.fused_attn = attention == "fused"


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit systems.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MAX_MMAP_THRESHOLD = 32 * 2**20


@functools.cache
def keep_freed_memory() -> bool:
    """Stop glibc's malloc from handing the step's freed activations back to the system, only to fault them
    in again, page by page, on the next step. By default it maps large blocks afresh and trims the heap
    as soon as its free top passes a few MiB: on a CPU fine-tuning step that was ~50,000 page faults a
    second and 12% of the process's time in the kernel. Blocks up to 32 MiB now come from the heap, which
    is trimmed only past 1 GiB free. Once per process; False where the C library does not take
    these settings (not glibc)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, 2**30),
            (_M_TOP_PAD, 64 * 2**20),
        )
    )


def maybe_compile(model: torch.nn.Module, choice: bool | str, device_type: str) -> torch.nn.Module:
    """`--loop.compile`: true, false, or auto (on a GPU only; see its help for the CPU measurements)."""
    if choice == "auto":
        choice = device_type == "cuda"
    return compile_model(model, device_type) if choice else model


def compile_model(model: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """`torch.compile(model)`, after checking what it needs: on a CPU, inductor builds C++ kernels, and
    without a compiler the first step would fail deep inside torch."""
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            from torch._inductor.exc import InvalidCxxCompiler
        except ImportError:  # a torch that moved them: let torch.compile speak for itself
            pass
        else:
            try:
                get_cpp_compiler()
            except InvalidCxxCompiler:
                raise ConfigError(
                    "--loop.compile true: torch.compile needs a C++ compiler on a CPU and found none; "
                    "install one (apt-get install g++, or set CXX) or use --loop.compile false"
                ) from None
    return torch.compile(model)


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as one state dict, whatever holds them: under FSDP or DeepSpeed ZeRO-3
    this gathers the shards, so every process must call it. Keys are the plain model's."""
    return accelerator.get_state_dict(getattr(model, "_orig_mod", model))  # the prepared module under compile


def plain_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model` without Accelerate's or torch.compile's wrappers: for exports, previews and EMA."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], **kwargs: Any):
    """timm's AdamW parameter groups (no decay on biases, norms, `no_weight_decay()`), with the fused
    kernel where torch has it: one kernel per step instead of a dozen per parameter."""
    from timm.optim import create_optimizer_v2

    try:
        return create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay, betas=betas, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # a device or dtype without the fused kernel
        return create_optimizer_v2(model, "adamw", lr=lr, weight_decay=weight_decay, betas=betas, **kwargs)
