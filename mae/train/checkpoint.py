"""Checkpoints and resume: crash-safe Accelerate checkpoints (written to a temporary folder, then renamed), which
checkpoint a run continues from, and whether the output folder can hold them.

A checkpoint folder `checkpoints/step_00001234` holds Accelerate's state (model, optimizer, RNG),
`loop_state.json` (where the loop was) and `config.yaml` (what it was running), so it is
complete and self-describing. A kill during a save leaves only a `.tmp-*` folder, which is
ignored and cleaned up; the previous checkpoint is never touched before the new one is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator

from mae.config import flatten, to_dict
from mae.data.open import recorded_path
from mae.errors import ConfigError
from mae.models.spec import SPEC_KEY
from mae.run_folder import (
    CONFIG,
    LOOP_STATE,
    STREAM_STATE,
    checkpoint_dir,
    follow_umask,
    list_checkpoints,
    partial_checkpoint_dir,
)


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str | os.PathLike,
    step: int,
    loop_state: dict[str, Any],
    config_yaml: str,
    keep: int,
    process_state: dict[str, Any] | None = None,
) -> Path:
    """Save the full training state at optimizer step `step`; keep the newest `keep`. `process_state`
    is this process's own (a stream's position: `STREAM_STATE`), written by every process."""
    final = checkpoint_dir(output_dir, step)
    tmp = partial_checkpoint_dir(output_dir, step)
    folder = final.parent
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp), safe_serialization=True)
        if process_state is not None:
            (tmp / STREAM_STATE.format(rank=accelerator.process_index)).write_text(json.dumps(process_state))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / LOOP_STATE).write_text(json.dumps(loop_state))
            (tmp / CONFIG).write_text(config_yaml)
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
    return json.loads((Path(checkpoint) / LOOP_STATE).read_text())


def load_process_state(checkpoint: str | os.PathLike, rank: int) -> dict[str, Any]:
    path = Path(checkpoint) / STREAM_STATE.format(rank=rank)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: this checkpoint has no stream position for process {rank} (was it saved by a run with "
            "another number of processes?); resume with the same processes, or pass --resume never"
        )
    return json.loads(path.read_text())


def _fsync_tree(folder: Path) -> None:
    """Flush every file so the rename never publishes a checkpoint the disk has not got; give each the
    permissions of the user's umask."""
    for p in folder.rglob("*"):
        if p.is_file():
            follow_umask(p)
            with open(p, "rb") as f:
                os.fsync(f.fileno())


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
    resume = getattr(cfg, "resume", "never")  # a stage that trains nothing (k-NN) has no checkpoints
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint; use auto, never or a checkpoint folder")


def config_record(cfg: Any) -> dict[str, Any]:
    """A config as a run's records keep it (config.yaml, a checkpoint's config, trackers, the resume check, export
    metadata, a shard index): plain YAML/JSON data, a `datasets.Dataset` object as its stand-in."""
    return to_dict(cfg, recorded_path)


def find_resume_checkpoint(cfg: Any) -> Path | None:
    """The checkpoint to continue from, after checking it ran the same config (epochs aside)."""
    if cfg.resume == "never":
        return None
    found = list_checkpoints(cfg.output_dir)[-1:] if cfg.resume == "auto" else [Path(cfg.resume)]
    if not found:
        return None
    ckpt = found[0]
    saved = flatten(yaml.safe_load((ckpt / CONFIG).read_text()))
    current = flatten(config_record(cfg))
    saved = {k: v for k, v in saved.items() if not k.startswith(f"{SPEC_KEY}.")}  # the model's record, not options
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

    need = checkpoint_bytes(model, optimizer) * (keep + 1)
    free = shutil.disk_usage(output_dir).free
    if free < need:
        raise ConfigError(
            f"--output_dir {output_dir}: {free / 2**30:.2f} GiB free, but {keep} checkpoints plus the one being "
            f"written need {need / 2**30:.2f} GiB; free some space, lower --loop.keep_checkpoints, "
            "or pick another folder"
        )
