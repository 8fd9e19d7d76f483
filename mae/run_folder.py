"""The run folder: the names of everything a run writes, and how to find it again.

One module owns the layout (after Accelerate's `ProjectConfiguration`): training stages, exports
and importers ask it for paths instead of spelling file names themselves.

    OUTPUT_DIR/
      config.yaml              the resolved config
      metrics.jsonl            one JSON object per logged step and per evaluation
      checkpoints/step_00000012/  Accelerate state + loop_state.json + config.yaml (written as .tmp-step_..., renamed)
      encoder.safetensors      pretraining: the encoder, timm key names
      decoder.safetensors      pretraining with the decoder exported: its weights beside the encoder's
      preview.png              pretraining: the latest reconstruction grid
      previews/epoch_0004.png  pretraining: the grid at each evaluation
      classifier.safetensors   linprobe / finetune: the whole timm classifier
      classes.json             linprobe / finetune / segment: class names, index = label
      segmenter.safetensors    segment: encoder + head, with what rebuilds it
      metrics.json             segment: the last evaluation (anomaly: its scores' AUROC)
      mae/                     TensorBoard event files (when tensorboard is installed; Accelerate's tracker)
      error.log                the traceback of a failed run (error-rankR.log for rank R > 0)
      .shared-<token>          for a moment at the start of a run on several processes: the main process's marker,
                               which every other process must see (the folder is on storage all nodes share)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LOOP_STATE = "loop_state.json"
STREAM_STATE = "stream_state_rank{rank}.json"  # a stream's position in a checkpoint, one per process
ENCODER = "encoder.safetensors"
CLASSIFIER = "classifier.safetensors"
CLASSES = "classes.json"
SEGMENTER = "segmenter.safetensors"
LAST_METRICS = "metrics.json"  # a run's last evaluation (segment), or anomaly's scores
# `mae predict` with a segmenter: OUT/<name>.png per image, and an overlay of the first images.
OVERLAY = "overlay.png"
PREVIEW = "preview.png"
PREVIEWS = "previews"
# An export in the layout timm's hub loader reads (`--format hf-folder`), and Accelerate's model file.
HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
DECODER = "decoder.safetensors"
# `mae anomaly`: one row per image, its maps, the most anomalous images, image (and pixel) AUROC and the ROC curve.
SCORES = "scores.csv"
MAPS = "maps"
MOST_ANOMALOUS = "most_anomalous.png"
ANOMALY_METRICS = "metrics.json"
ROC = "roc.png"
# A name of its own per run: a node that looked the name up before (and cached "no such file") cannot miss a new one.
SHARED_MARKER = ".shared-{token}"

_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step:08d}"


def partial_checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where a checkpoint is written before it is renamed into place (never read as a checkpoint)."""
    return Path(output_dir) / CHECKPOINTS / f".tmp-step_{step:08d}"


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `output_dir/checkpoints`, oldest first."""
    folder = Path(output_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def is_checkpoint(folder: str | os.PathLike) -> bool:
    """A checkpoint folder itself (its config and Accelerate's model file side by side)."""
    p = Path(folder)
    return (p / CONFIG).is_file() and (p / HF_WEIGHTS).is_file()


def run_config(source: str | os.PathLike) -> dict[str, Any] | None:
    """The resolved config of the run at `source` (a run folder or one of its checkpoints), if any."""
    import yaml

    p = Path(source)
    if not p.is_dir():
        return None
    for candidate in (p / CONFIG, *(c / CONFIG for c in list_checkpoints(p)[-1:])):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text())
    return None


def decoder_beside(weights: str | os.PathLike) -> Path:
    """Where the decoder of the encoder export `weights` lives: `decoder.safetensors` beside a run's
    encoder.safetensors or an hf folder's model.safetensors, else `NAME.decoder.safetensors` beside NAME.safetensors
    (a sibling, so timm still reads the encoder file alone)."""
    p = Path(weights)
    if p.name in (ENCODER, HF_WEIGHTS):
        return p.with_name(DECODER)
    return p.with_name(f"{p.name.removesuffix('.safetensors')}.decoder.safetensors")


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every line of a run's metrics.jsonl ([] when it has none)."""
    import json

    path = Path(output_dir) / METRICS
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()] if path.is_file() else []


def last_evaluation(output_dir: str | os.PathLike) -> dict[str, Any]:
    """The last evaluation line of a run's metrics.jsonl, without its step and epoch ({} when there is none)."""
    last = next((m for m in reversed(read_metrics(output_dir)) if "eval" in m), {})
    return {k: v for k, v in last.items() if k not in ("step", "epoch")}


def preview_path(epoch: int) -> str:
    """A preview's path relative to the run folder (as metrics.jsonl records it)."""
    return f"{PREVIEWS}/epoch_{epoch:04d}.png"


def shared_marker(output_dir: str | os.PathLike, token: str) -> Path:
    """The marker the main process writes at the start of a multi-process run and every other process reads."""
    return Path(output_dir) / SHARED_MARKER.format(token=token)


def error_log(output_dir: str | os.PathLike, rank: int) -> Path:
    return Path(output_dir) / ("error.log" if rank == 0 else f"error-rank{rank}.log")


def follow_umask(path: str | os.PathLike) -> None:
    """Set a written file's mode to what the umask gives new files: safetensors writes 0600, which
    colleagues on shared storage cannot read, while everything else a run writes follows the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
