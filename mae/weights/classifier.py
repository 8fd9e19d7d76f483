"""Classifiers out and in: a whole timm classifier (encoder + head) as safetensors, and back with its
eval transform and class names."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from mae.errors import CheckpointError
from mae.run_folder import CLASSES, CLASSIFIER, ENCODER
from mae.version import __version__
from mae.weights.export import timm_pretrained_cfg
from mae.weights.files import cpu_tensors, read_metadata, write_safetensors


def save_classifier(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    arch: str,
    args: dict[str, Any],
    classes: list[str],
    mean: list[float],
    std: list[float],
    config: dict[str, Any] | None = None,
    crop_pct: float = 0.875,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A whole timm classifier (encoder + head) as safetensors that `timm.create_model` loads, head
    included, when given the `pretrained_cfg` in its metadata (see docs/weights.md); `load_classifier` reads it."""
    args = {**args, "num_classes": len(classes)}
    size = args["img_size"]
    size = [size, size] if isinstance(size, int) else list(size)
    pretrained_cfg = timm_pretrained_cfg([args.get("in_chans", 3), *size], mean, std, len(classes), crop_pct)
    metadata = {
        "format": "pt",
        "architecture": arch,
        "model_args": json.dumps(args),
        "pretrained_cfg": json.dumps(pretrained_cfg),
        "classes": json.dumps(classes),
        "mean": json.dumps(list(mean)),
        "std": json.dumps(list(std)),
        "mae_version": __version__,
    }
    if config is not None:
        metadata["config"] = json.dumps(config)
    return write_safetensors(cpu_tensors(model.state_dict() if state is None else state), path, metadata)


@dataclass(frozen=True)
class Classifier:
    """A trained classifier: `classes[model(transform(image)[None]).argmax(1)]` names an image's class."""

    model: nn.Module  # the timm model with its head, in eval mode
    transform: Callable[[Any], torch.Tensor]  # PIL image (float tensor [C, H, W] for C != 3) -> normalised tensor
    classes: list[str]


def load_classifier(path: str | os.PathLike) -> Classifier:
    """The classifier a `mae linprobe` or `mae finetune` run wrote: `path` is its `classifier.safetensors`
    or its output folder (which also holds `classes.json`)."""
    p = Path(path)
    if p.is_dir():  # a pretraining folder has only an encoder: say so below
        p = p / CLASSIFIER if (p / CLASSIFIER).is_file() or not (p / ENCODER).is_file() else p / ENCODER
    if not p.is_file():
        raise CheckpointError(f"{path}: no {CLASSIFIER} there; train one with mae linprobe or mae finetune")
    meta = read_metadata(p)
    if "architecture" not in meta or "model_args" not in meta or "pretrained_cfg" not in meta:
        raise CheckpointError(f"{p}: not a classifier of this toolkit (no architecture metadata)")
    args = json.loads(meta["model_args"])
    classes = _classes(p, meta)
    if not classes or not args.get("num_classes"):
        raise CheckpointError(
            f"{p}: an encoder export has no classifier head; fine-tune or probe it first (mae finetune / mae linprobe)"
        )
    pretrained_cfg = json.loads(meta["pretrained_cfg"])
    model = timm.create_model(
        meta["architecture"], pretrained=True, pretrained_cfg_overlay={**pretrained_cfg, "file": str(p)}, **args
    ).eval()  # timm loads the file strictly, head included, since its class count is the file's
    return Classifier(model, eval_transform(model, pretrained_cfg), classes)


def _classes(path: Path, meta: dict[str, str]) -> list[str]:
    if "classes" in meta:
        return list(json.loads(meta["classes"]))
    beside = path.parent / CLASSES
    return list(json.loads(beside.read_text())) if beside.is_file() else []


def eval_transform(model: nn.Module, pretrained_cfg: dict[str, Any]) -> Callable[[Any], torch.Tensor]:
    """timm's eval transform from the model's data config for RGB (PIL in); for any other channel count the
    same resize / centre-crop / normalise on float tensors [C, H, W] (PIL has no such images)."""
    from timm.data import create_transform, resolve_data_config

    config = resolve_data_config({}, model=model)
    if pretrained_cfg["input_size"][0] == 3:
        return create_transform(**config, is_training=False)
    from torchvision.transforms import v2

    size = list(config["input_size"][1:])
    side = math.floor(min(size) / config["crop_pct"])
    return v2.Compose(
        [
            v2.Resize(side, interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
            v2.CenterCrop(size),
            v2.Normalize(list(config["mean"]), list(config["std"])),
        ]
    )
