"""The Accelerator of a stage: precision (bf16 where it pays), trackers, CPU multi-process, seeding, a run folder
every process sees, and the views of the model that exports and previews need."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast_object_list, gather_object, set_seed

from mae.errors import ConfigError
from mae.run_folder import shared_marker

# How long a process looks for the main process's marker: a network file system shows a new file at once (NFS
# re-reads on open, and the name is new), so the wait only covers storage that publishes files with a short delay.
SHARED_WAIT_S = 5.0


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


def open_accelerator(cfg: Any) -> Accelerator:
    """The Accelerator for a stage, seeded; `cfg` has `loop`, `output_dir` and `seed`. A stage that trains nothing
    has no `loop.accum_steps` or `loop.log_with` (it takes one step per batch and logs to no tracker)."""
    loop = cfg.loop
    precision = resolve_precision(loop.mixed_precision)
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        # Accelerate fixes the precision once per process, with no public reset; a later stage may need another.
        AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=precision,
        gradient_accumulation_steps=getattr(loop, "accum_steps", 1),
        log_with=resolve_tracker(getattr(loop, "log_with", "none")),
        project_dir=str(cfg.output_dir),
        cpu=_multi_process_cpu(),
    )
    check_shared_output_dir(accelerator, cfg.output_dir)
    set_seed(cfg.seed)
    return accelerator


def close_accelerator(accelerator: Accelerator) -> None:
    """End a stage: every process waits until the main one has written its files, then the process group ends here,
    not in the interpreter's exit, where gloo can abort a process ("terminate called without an active exception");
    one that left while the main process still wrote would have torchrun stop the main process mid-write."""
    accelerator.wait_for_everyone()
    accelerator.end_training()


def check_shared_output_dir(accelerator: Accelerator, output_dir: str | os.PathLike) -> None:
    """Every process sees the run folder the main process writes: the main process renames the checkpoint folders
    all processes write into and alone writes metrics and exports, so a node with its own disk under --output_dir
    would train to the end and leave its share of every checkpoint where no resume finds it.

    The main process writes a marker with a fresh token and sends the token; every other process reads the marker;
    all gather who saw it, so every process (on every node) stops with the same line and none is left waiting."""
    if accelerator.num_processes == 1:
        return
    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    if accelerator.is_main_process:
        shared_marker(output_dir, token[0]).write_text(token[0])
    broadcast_object_list(token)  # also the barrier: the marker is written before any process looks for it
    seen = accelerator.is_main_process or _sees_marker(shared_marker(output_dir, token[0]), token[0])
    everyone = gather_object([(accelerator.process_index, socket.gethostname(), str(output_dir), seen)])
    if accelerator.is_main_process:
        shared_marker(output_dir, token[0]).unlink(missing_ok=True)
    blind = [(rank, host, folder) for rank, host, folder, ok in everyone if not ok]
    if blind:
        main_host, main_folder = everyone[0][1], everyone[0][2]
        rank, host, folder = blind[0]
        others = f" and {len(blind) - 1} other process(es)" if len(blind) > 1 else ""
        raise ConfigError(
            f"--output_dir {folder}: the process on host {host} (rank {rank}){others} cannot see the run folder the "
            f"main process on host {main_host} writes ({main_folder}); --output_dir must be on storage all nodes "
            "share (the same folder mounted on every node), not a node's own disk"
        )


def _sees_marker(path: Path, token: str) -> bool:
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as one state dict, whatever holds them: under FSDP or DeepSpeed ZeRO-3
    this gathers the shards, so every process must call it. Keys are the plain model's."""
    return accelerator.get_state_dict(getattr(model, "_orig_mod", model))  # the prepared module under compile


def plain_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`model` without Accelerate's or torch.compile's wrappers: for exports, previews and EMA."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def warn(accelerator: Accelerator, message: str) -> None:
    """A warning about the run's settings, once (main process), on stderr."""
    if accelerator.is_main_process:
        print(f"warning: {message}", file=sys.stderr, flush=True)
