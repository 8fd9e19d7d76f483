"""Speed settings of the network that runs: attention kernel, torch.compile, and the C library's handling of
freed memory on a CPU."""

from __future__ import annotations

import ctypes
import functools

import torch

from mae.errors import ConfigError


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
