"""Weights out as ONNX: an encoder (pooled features and token features), a trained classifier (logits) or a segmenter
(per-pixel logits [N, K, H, W] at its input size), with a dynamic batch axis and the input size and normalisation in
the model's `metadata_props`.

torch's TorchScript exporter (`torch.onnx.export(dynamo=False)`), not the dynamo one: it needs no onnxscript and
exports timm's ViTs with a dynamic batch the same way across the torch versions we accept (2.4 to 2.14).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from mae.errors import CheckpointError, ConfigError
from mae.models.mae import MaskedAutoencoder
from mae.models.spec import ModelSpec
from mae.version import __version__
from mae.weights.classifier import classifier_file, load_classifier
from mae.weights.export import encoder_pretrained_cfg, model_stats, timm_pretrained_cfg
from mae.weights.importers import load_pretrained, read_encoder
from mae.weights.record import read_spec, spec_metadata
from mae.weights.segmenter import KIND, load_segmenter, model_input, segmenter_file

OPSET = 17  # LayerNorm is one ONNX op from opset 17; onnxruntime >= 1.14 runs it
TOLERANCE = 1e-4  # onnxruntime's fp32 outputs against torch's, absolute and relative
INPUT = "pixel_values"


@dataclass(frozen=True)
class Deployable:
    """What an export runs: a timm ViT in eval mode, its `pretrained_cfg` (input size, mean, std, crop) and its
    class names (none for an encoder)."""

    model: nn.Module
    pretrained_cfg: dict[str, Any]
    classes: list[str]
    spec: ModelSpec | None = None  # the model record (a classifier's: its encoder's), written into the metadata
    kind: str = ""  # "segmenter" for per-pixel logits; else a classifier (classes) or an encoder

    @property
    def outputs(self) -> list[str]:
        return ["logits"] if self.classes else ["features", "tokens"]


class _Outputs(nn.Module):
    """A classifier's logits [N, classes], or an encoder's pooled features [N, D] and tokens [N, T, D]."""

    def __init__(self, model: nn.Module, classifier: bool) -> None:
        super().__init__()
        self.model, self.classifier = model, classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.classifier:
            return self.model(x)
        tokens = self.model.forward_features(x)
        return self.model.forward_head(tokens, pre_logits=True), tokens


def open_deployable(
    source: MaskedAutoencoder | str | os.PathLike, img_size: tuple[int, int] | None = None
) -> Deployable:
    """A segmenter (a segment folder or its segmenter.safetensors), a classifier (a linprobe / finetune folder or its
    classifier.safetensors) or an encoder (a model, an
    export, a run, any checkpoint `load_pretrained` reads; `img_size` for one whose input size it cannot tell)."""
    if isinstance(source, MaskedAutoencoder):
        return Deployable(source.encoder.eval(), encoder_pretrained_cfg(source), [], source.spec)
    if not Path(source).exists():
        raise CheckpointError(f"{source}: no such file or folder")
    if segmenter_file(source) is not None:
        s = load_segmenter(source)
        stats = [s.transform.mean.flatten().tolist(), s.transform.std.flatten().tolist()]
        cfg = timm_pretrained_cfg(list(model_input(s.model)), *stats, len(s.classes), 1.0)
        return Deployable(s.model, cfg, s.classes, read_spec(segmenter_file(source)), kind=KIND)
    if classifier_file(source) is not None:
        c = load_classifier(source)
        return Deployable(c.model, dict(c.model.pretrained_cfg), c.classes, read_spec(classifier_file(source)))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*encoder only.*")  # the decoder is not exported
            if img_size is not None:
                mae = load_pretrained(source, img_size=tuple(img_size))
                return Deployable(mae.encoder.eval(), encoder_pretrained_cfg(mae), [], mae.spec)
            spec = read_encoder(str(source))
    except CheckpointError as e:
        if "img_size" in str(e):  # a grid no metadata or shape tells (a non-square one)
            raise CheckpointError(f"{source}: its input size is unknown ({e}); give it with --img_size H W") from None
        raise
    vit = timm.create_model(spec.arch, pretrained=False, num_classes=0, **spec.args)
    vit.load_state_dict(spec.state)
    cfg = timm_pretrained_cfg([spec.in_chans, *spec.img_size], *model_stats(spec.record), 0)
    return Deployable(vit.eval(), cfg, [], spec.record)


def export_onnx(
    source: MaskedAutoencoder | str | os.PathLike,
    path: str | os.PathLike,
    *,
    img_size: tuple[int, int] | None = None,
    opset: int = OPSET,
    verify: bool = True,
) -> Path:
    """Write `source` (see `open_deployable`) as an ONNX model taking `pixel_values` [N, C, H, W] (normalised;
    N free) to `logits`, or to `features` [N, D] and `tokens` [N, T, D]; `verify` compares onnxruntime's outputs
    with torch's at two batch sizes when onnxruntime is installed."""
    onnx = _require("onnx")
    d = open_deployable(source, img_size)
    net = _Outputs(d.model, bool(d.classes)).eval()
    c, h, w = d.pretrained_cfg["input_size"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {name: {0: "batch"} for name in (INPUT, *d.outputs)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # timm's shape asserts, traced
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.onnx.export(net, (torch.randn(2, c, h, w),), str(path), dynamo=False, opset_version=opset,
                          input_names=[INPUT], output_names=d.outputs, dynamic_axes=axes)  # fmt: skip
    proto = onnx.load(str(path), load_external_data=False)  # models over 2 GB keep their weights beside
    onnx.helper.set_model_props(proto, _metadata(d, opset))
    proto.doc_string = f"{d.pretrained_cfg.get('architecture', '')} exported by mae {__version__}".strip()
    onnx.save(proto, str(path))
    if verify:
        check_onnx(path, net, batch_sizes=(1, 3))
    return path


def _metadata(d: Deployable, opset: int) -> dict[str, str]:
    cfg = d.pretrained_cfg
    meta = {
        "mae_kind": d.kind or ("classifier" if d.classes else "encoder"),
        "input_name": INPUT,
        "outputs": json.dumps(d.outputs),
        "input_size": json.dumps(list(cfg["input_size"])),
        "mean": json.dumps(list(cfg["mean"])),
        "std": json.dumps(list(cfg["std"])),
        "crop_pct": str(cfg.get("crop_pct", 0.875)),
        "interpolation": str(cfg.get("interpolation", "bicubic")),
        "opset": str(opset),
        "mae_version": __version__,
    }
    if d.classes:
        meta["classes"] = json.dumps(d.classes)
    if d.spec is not None:
        meta |= spec_metadata(d.spec)
    return meta


def onnx_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `metadata_props` of an ONNX model as a dict."""
    onnx = _require("onnx")
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def check_onnx(path: str | os.PathLike, net: nn.Module, batch_sizes: tuple[int, ...] = (1, 3)) -> float:
    """The largest difference between onnxruntime's outputs and `net`'s on random inputs at `batch_sizes`
    (CheckpointError beyond `TOLERANCE`, absolute and relative); 0.0 without onnxruntime (nothing checked)."""
    try:
        import onnxruntime
    except ImportError:
        return 0.0
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shape = session.get_inputs()[0].shape[1:]
    worst, generator = 0.0, torch.Generator().manual_seed(0)
    for n in batch_sizes:
        x = torch.randn(n, *shape, generator=generator)
        with torch.no_grad():
            expected = net(x)
        expected = expected if isinstance(expected, tuple) else (expected,)
        for got, want in zip(session.run(None, {INPUT: x.numpy()}), expected, strict=True):
            diff = (torch.from_numpy(got) - want).abs()
            worst = max(worst, diff.max().item())
            if (diff > TOLERANCE * (1 + want.abs())).any():  # torch.testing's atol = rtol = TOLERANCE
                raise CheckpointError(
                    f"{path}: onnxruntime's outputs differ from torch's by up to {diff.max().item():.2g} at batch "
                    f"{n}; the export is wrong"
                )
    return worst


def _require(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"--format onnx needs the {name} package: pip install 'mae-toolkit[onnx]'") from None
