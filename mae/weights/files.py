"""Weight files on disk: the one safetensors metadata reader and the one atomic writer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mae.errors import CheckpointError
from mae.run_folder import follow_umask


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a safetensors file ({} when it has none); CheckpointError when unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def cpu_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous, unshared CPU copies: what safetensors writes (it refuses shared or strided storage)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> Path:
    """Write `tensors` with string `metadata` atomically (a reader never sees half a file), mode per the umask."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    follow_umask(tmp)
    os.replace(tmp, path)
    return path
