"""Classifiers out and in: a whole timm classifier (encoder + head) as safetensors, and back with its
eval transform and class names."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors.torch import load_file
from torch import nn

from mae.errors import CheckpointError
from mae.models.spec import ModelSpec
from mae.run_folder import CLASSES, CLASSIFIER, ENCODER, HF_WEIGHTS, METRICS
from mae.version import __version__
from mae.weights.export import timm_pretrained_cfg
from mae.weights.files import cpu_tensors, read_metadata, write_safetensors
from mae.weights.record import spec_metadata


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
    record: ModelSpec | None = None,
) -> Path:
    """A whole timm classifier (encoder + head) as safetensors that `timm.create_model` loads, head
    included, when given the `pretrained_cfg` in its metadata (see docs/weights.md); `load_classifier` reads it.
    `record`: the model record of its encoder, written with this classifier's input size and statistics."""
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
        "mae_version": __version__,
    }
    if record is not None:
        record = replace(record, img_size=tuple(size)).with_stats(tuple(mean), tuple(std))
        metadata |= spec_metadata(record)
    if config is not None:
        metadata["config"] = json.dumps(config)
    return write_safetensors(cpu_tensors(model.state_dict() if state is None else state), path, metadata)


@dataclass(frozen=True)
class Classifier:
    """A trained classifier: `classes[model(transform(image)[None]).argmax(1)]` names an image's class."""

    model: nn.Module  # the timm model with its head, in eval mode
    transform: Callable[[Any], torch.Tensor]  # PIL image (float tensor [C, H, W] for C != 3) -> normalised tensor
    classes: list[str]


def classifier_file(path: str | os.PathLike) -> Path | None:
    """The classifier `path` names (a linprobe / finetune output folder, its classifier.safetensors, or an hf
    folder of one), or None when it holds something else (an encoder export, a checkpoint, nothing)."""
    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in (CLASSIFIER, HF_WEIGHTS) if (p / n).is_file()), p / CLASSIFIER)
    if not p.is_file() or p.suffix != ".safetensors":
        return None
    meta = read_metadata(p)
    num_classes = json.loads(meta["model_args"]).get("num_classes") if "model_args" in meta else None
    return p if num_classes and _classes(p, meta) else None


def load_classifier(path: str | os.PathLike) -> Classifier:
    """The classifier a `mae linprobe` or `mae finetune` run wrote: `path` is its `classifier.safetensors`,
    its output folder (which also holds `classes.json`), or an hf folder `mae export` made of it."""
    p = Path(path)
    if p.is_dir():  # a pretraining folder has only an encoder: say so below
        p = next((p / n for n in (CLASSIFIER, HF_WEIGHTS, ENCODER) if (p / n).is_file()), p / CLASSIFIER)
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


def export_classifier(
    source: str | os.PathLike, path: str | os.PathLike, format: str = "safetensors", *, license: str = "apache-2.0"
) -> Path:
    """Write the classifier at `source` (see `classifier_file`) as one safetensors file (class names in its
    metadata) or as an hf folder: model.safetensors, timm's config.json with `label_names`, a model card."""
    file = classifier_file(source)
    if file is None:
        raise CheckpointError(f"{source}: not a classifier (no head, or no class names beside it)")
    meta = read_metadata(file)
    meta.setdefault("classes", json.dumps(_classes(file, meta)))  # older runs kept them in classes.json only
    tensors = load_file(str(file))
    if format == "safetensors":
        return write_safetensors(tensors, path, meta)
    from mae.weights.card import model_card
    from mae.weights.export import write_hf_config

    folder = Path(path)
    weights = write_safetensors(tensors, folder / HF_WEIGHTS, meta)
    args, classes = json.loads(meta["model_args"]), json.loads(meta["classes"])
    write_hf_config(folder, meta["architecture"], args, json.loads(meta["pretrained_cfg"]), label_names=classes)
    config = json.loads(meta["config"]) if "config" in meta else None
    run_dir = file.parent if (file.parent / METRICS).is_file() else None
    vit = load_classifier(weights).model
    card = model_card(vit, config=config, run_dir=run_dir, classes=classes, license=license)
    (folder / "README.md").write_text(card)
    return folder


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
