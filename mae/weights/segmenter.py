"""Segmenters out and in: encoder + head as one safetensors file whose metadata rebuilds it alone (the encoder's
timm architecture and arguments, the head's name and arguments, the classes, their colours, the input statistics
and the model record), and `load_segmenter`, which gives the model, its transform and its class names."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import timm
import torch
from safetensors.torch import load_file
from torch import nn

from mae.errors import CheckpointError
from mae.models.segmenter import HEADS, Segmenter
from mae.models.spec import ModelSpec
from mae.run_folder import SEGMENTER
from mae.version import __version__
from mae.weights.files import cpu_tensors, read_metadata, write_safetensors
from mae.weights.record import spec_metadata

KIND = "segmenter"  # the metadata `mae_kind` of a segmenter file


def default_palette(num_classes: int) -> list[list[int]]:
    """PASCAL VOC's colour map (bit-interleaved index): distinct colours for any class count, 0 black."""
    colours = []
    for i in range(num_classes):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        colours.append([r, g, b])
    return colours


def palette_of(flat: list[int] | None, num_classes: int) -> list[list[int]]:
    """[[r, g, b]] per class from a PIL palette (flat RGB values) where the masks had one, else `default_palette`."""
    if flat and len(flat) >= 3 * num_classes:
        return [list(flat[3 * i : 3 * i + 3]) for i in range(num_classes)]
    return default_palette(num_classes)


def save_segmenter(model: Segmenter, path: str | os.PathLike, *, arch: str, args: dict[str, Any], head: str,
                   classes: list[str], palette: list[list[int]], mean: list[float], std: list[float],
                   record: ModelSpec | None = None, config: dict[str, Any] | None = None,
                   state: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """`model`'s weights (or `state`, a gathered full state dict) with what rebuilds it (`load_segmenter`)."""
    embed_dim = model.encoder.num_features
    head_args = {"embed_dim": embed_dim, "num_classes": len(classes), "patch_size": model.patch_size[0]}
    metadata = {
        "format": "pt",
        "mae_kind": KIND,
        "architecture": arch,
        "model_args": json.dumps(args),
        "head": head,
        "head_args": json.dumps(head_args),
        "classes": json.dumps(classes),
        "palette": json.dumps(palette),
        "mean": json.dumps(list(mean)),
        "std": json.dumps(list(std)),
        "mae_version": __version__,
    }
    if record is not None:
        metadata |= spec_metadata(replace(record, img_size=tuple(model.img_size)).with_stats(tuple(mean), tuple(std)))
    if config is not None:
        metadata["config"] = json.dumps(config)
    return write_safetensors(cpu_tensors(model.state_dict() if state is None else state), path, metadata)


def segmenter_file(path: str | os.PathLike) -> Path | None:
    """The segmenter `path` names (a `mae segment` output folder or its segmenter.safetensors), or None."""
    p = Path(path)
    if p.is_dir():
        p = p / SEGMENTER
    if not p.is_file() or p.suffix != ".safetensors":
        return None
    return p if read_metadata(p).get("mae_kind") == KIND else None


@dataclass(frozen=True)
class LoadedSegmenter:
    """A trained segmenter: `model.segment(transform(image)[None]).argmax(1)` is an image's class map (indices into
    `classes`); unpacks as (model, transform, classes)."""

    model: Segmenter  # in eval mode
    transform: Callable[[Any], torch.Tensor]  # PIL image (float tensor [C, H, W] for C != 3) -> normalised tensor
    classes: list[str]
    palette: list[list[int]]  # [r, g, b] per class, for mask PNGs and overlays

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.transform, self.classes))


class ImageTransform:
    """A PIL image or a float tensor [C, H, W] in [0, 1] -> the normalised float tensor [C, H, W], its size kept."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: Any) -> torch.Tensor:
        from mae.data.segmentation import image_tensor

        return (image_tensor(img) - self.mean) / self.std


def load_segmenter(path: str | os.PathLike) -> LoadedSegmenter:
    """The segmenter a `mae segment` run wrote: its output folder or its segmenter.safetensors."""
    p = segmenter_file(path)
    if p is None:
        raise CheckpointError(f"{path}: no {SEGMENTER} there (train one with mae segment)")
    meta = read_metadata(p)
    args, head_args = json.loads(meta["model_args"]), json.loads(meta["head_args"])
    kind = HEADS.get(meta["head"])  # a user's head: registered by the same import as when it was trained
    encoder = timm.create_model(meta["architecture"], pretrained=False, num_classes=0, **args)
    model = Segmenter(encoder, kind.build(**head_args), frozen_encoder=not kind.trains_encoder)
    missing, unexpected = model.load_state_dict(load_file(str(p)), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{p}: the weights do not fit its record: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}")  # fmt: skip
    classes = json.loads(meta["classes"])
    mean, std = json.loads(meta["mean"]), json.loads(meta["std"])
    return LoadedSegmenter(model.eval(), ImageTransform(mean, std), classes, json.loads(meta["palette"]))


def model_input(segmenter: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) of a segmenter's input window."""
    return (segmenter.encoder.patch_embed.proj.in_channels, *segmenter.img_size)
