"""Crash-safe Accelerate checkpoints: write to a temporary folder, then rename.

A checkpoint folder `checkpoints/step_00001234` holds Accelerate's state (model, optimizer, RNG),
`loop_state.json` (where the loop was) and `config.yaml` (what it was running), so it is
complete and self-describing. A kill during a save leaves only a `.tmp-*` folder, which is
ignored and cleaned up; the previous checkpoint is never touched before the new one is whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

_NAME = re.compile(r"^step_(\d+)$")


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `output_dir/checkpoints`, oldest first."""
    folder = Path(output_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | os.PathLike,
    step: int,
    loop_state: dict[str, Any],
    config_yaml: str,
    keep: int,
) -> Path:
    """Save the full training state at optimizer step `step`; keep the newest `keep`."""
    folder = Path(output_dir) / "checkpoints"
    final = folder / f"step_{step:08d}"
    tmp = folder / f".tmp-step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "loop_state.json").write_text(json.dumps(loop_state))
            (tmp / "config.yaml").write_text(config_yaml)
            _fsync_tree(tmp)
    except OSError:  # e.g. the disk filled up: drop the partial folder, keep every complete checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        if final.exists():  # same step saved twice (e.g. a stop right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in folder.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_loop_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "loop_state.json").read_text())


def _fsync_tree(folder: Path) -> None:
    """Flush every file so the rename never publishes a checkpoint the disk has not got; give each the
    permissions of the user's umask."""
    for p in folder.rglob("*"):
        if p.is_file():
            follow_umask(p)
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def follow_umask(path: str | os.PathLike) -> None:
    """Set a written file's mode to what the umask gives new files: safetensors writes 0600, which
    colleagues on shared storage cannot read, while everything else a run writes follows the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def checkpoint_bytes(model, optimizer) -> int:
    """What one checkpoint of this model and optimizer takes on disk (weights + optimizer state)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state_dict()["state"].values()
        for t in s.values()
        if hasattr(t, "numel")
    )
    # Adam's moments are created on the first step: count them as two copies of the weights until then.
    return params + buffers + max(state, 2 * params)
