"""The model card (README.md) of an hf folder, written from the run: its data, its recipe, its evaluations
(metrics.jsonl), what the weights are for, and the metadata the Hub reads (`library_name: timm`, tags, license)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from mae.models.encoder import encoder_adapter
from mae.run_folder import METRICS, read_metrics, run_config
from mae.weights.files import read_metadata


def model_card(
    vit: nn.Module,
    *,
    config: dict[str, Any] | None,
    run_dir: str | os.PathLike | None = None,
    classes: list[str] | None = None,
    license: str = "apache-2.0",
    repo_id: str | None = None,
    with_decoder: bool = False,
) -> str:
    """The card of `vit` (a timm ViT: an encoder, or a classifier when `classes` are given) from its run's
    resolved `config` and the run folder `run_dir` (metrics.jsonl)."""
    adapter = encoder_adapter(vit)
    arch = adapter.timm_architecture()[0]
    pretraining = _pretraining_config(config)
    what = "image-classification" if classes else "image-feature-extraction"
    title = f"{arch} {'classifier' if classes else 'encoder'}, pretrained as a masked autoencoder"
    lines = [
        "---",
        "library_name: timm",
        f"license: {license}",
        f"tags: [{what}, mae, masked-autoencoder, timm]",
        f"pipeline_tag: {what}",
        "---",
        f"# {title}",
        "",
        *_summary(adapter, classes, with_decoder),
        "",
        *_usage(adapter, classes, repo_id),
        "",
        "## Data",
        "",
        *_data(pretraining, config if classes else None, adapter.in_chans, classes),
        "",
        "## Recipe",
        "",
        *_recipe(pretraining),
        "",
        "## Evaluations",
        "",
        *_evaluations(config, run_dir),
        "",
        "## Intended use",
        "",
        "Research and transfer: image features for retrieval, k-NN or linear probes, and a starting point for",
        "fine-tuning on images like the training data (same channels, normalisation and scale). It was not",
        "evaluated for fairness, robustness or safety; check it on your own data before relying on it.",
        "",
    ]
    return "\n".join(lines)


def _summary(adapter: Any, classes: list[str] | None, with_decoder: bool) -> list[str]:
    text = f"A {adapter.describe()} input, trained with the `mae` toolkit"
    if classes:
        return [f"{text} and then fitted to {len(classes)} classes: {', '.join(classes[:20])}."]
    decoder = " Its MAE decoder is in `decoder.safetensors` (`mae.load_pretrained` reads both)." if with_decoder else ""
    return [f"{text}. It has no classifier head: use it as a feature extractor or fine-tune it.{decoder}"]


def _usage(adapter: Any, classes: list[str] | None, repo_id: str | None) -> list[str]:
    # forward_features returns the prefix tokens (class and/or register tokens) before the L patch tokens.
    prefix = adapter.num_prefix_tokens
    registers = prefix - int(adapter.has_class_token)
    parts = (["1 class token"] if adapter.has_class_token else ["no class token"]) + (
        [f"{registers} register tokens"] if registers else []
    )
    tokens = f"{prefix} + L" if prefix else "L"
    (h, w), (gh, gw) = adapter.img_size, adapter.grid_size
    out = "logits = model(images)" + " " * 31 + f"# [N, {len(classes)}]" if classes else ""
    return [
        "```python",
        "import timm",
        f'model = timm.create_model("hf-hub:{repo_id or "OWNER/NAME"}", pretrained=True)'
        '  # or "local-dir:/path/to/this/folder"',
        f"features = model.forward_features(images)               # [N, {tokens}, {adapter.embed_dim}]",
        *([out] if out else []),
        "```",
        "",
        f"`forward_features` gives {', '.join(parts)} and L = {gh} x {gw} = {gh * gw} patch tokens at {h}x{w}; "
        f"images are {adapter.in_chans}-channel, normalised with the mean and std in config.json's pretrained_cfg.",
    ]


def _data(pretraining: dict[str, Any], labeled: dict[str, Any] | None, channels: int, classes: list[str] | None):
    data = pretraining.get("data", {})
    source = data.get("path") or ("built-in demo images" if pretraining else "unknown")
    count = _image_count(data.get("path"))
    lines = [f"- pretraining images: {source}" + (f" ({count} images)" if count else ""), f"- channels: {channels}"]
    if "mean" in data:
        lines.append(f"- normalisation: mean {data['mean']}, std {data['std']}")
    if labeled is not None:
        d = labeled.get("data", {})
        val = f", validation {d['val_path']}" if d.get("val_path") else ""
        lines.append(f"- labeled images: {d.get('path')}{val}")
        lines.append(f"- classes ({len(classes or [])}): {', '.join(classes or [])}")
    return lines


def _recipe(pretraining: dict[str, Any]) -> list[str]:
    if not pretraining:
        return ["- not recorded (the weights came without their run's config)"]
    m, loop = pretraining.get("model", {}), pretraining.get("loop", {})
    return [
        f"- {loop.get('epochs', '?')} epochs of MAE pretraining from the preset {m.get('name', '?')}",
        f"- mask ratio {m.get('mask_ratio', '?')}, masking {m.get('masking', 'random')}",
        f"- decoder {m.get('decoder', 'mae')}"
        + (f" ({m['decoder_embed_dim']} wide, {m['decoder_depth']} blocks)" if m.get("decoder_embed_dim") else ""),
        f"- normalised-pixel loss: {m.get('norm_pix_loss', True)}",
    ]


def _evaluations(config: dict[str, Any] | None, run_dir: str | os.PathLike | None) -> list[str]:
    rows = []
    pretrained = (config or {}).get("pretrained")
    folders = [run_dir] + ([pretrained] if pretrained and Path(pretrained).is_dir() else [])
    for folder in folders:
        if folder is None or not (Path(folder) / METRICS).is_file():
            continue
        kind = _stage_of(run_config(folder) or (config if folder == run_dir else None))
        for name, top1 in _last_top1(folder, kind).items():
            rows.append(f"| {name} | {top1:.2f} | {folder} |")
    if not rows:
        return ["None recorded with these weights."]
    return ["| evaluation | top-1 (%) | run |", "|---|---|---|", *rows]


def _stage_of(config: dict[str, Any] | None) -> str:
    c = config or {}
    return "fine-tune" if "aug" in c else "linear probe" if "mode" in c else "k-NN" if "k" in c else "pretraining"


def _last_top1(run_dir: str | Path, kind: str) -> dict[str, float]:
    """The last top-1 of each evaluation in a run's metrics.jsonl: the stage's own, and the k-NN monitor's."""
    found: dict[str, float] = {}
    for record in read_metrics(run_dir):
        if "top1" in record and "eval" in record:
            found[kind] = record["top1"]
        if "knn_top1" in record:
            found["k-NN (monitor during pretraining)"] = record["knn_top1"]
    return found


def _pretraining_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """The pretraining run's config: `config` itself, or that of the run (or export) a downstream run started from."""
    if not config:
        return {}
    if "mask_ratio" in config.get("model", {}):
        return config
    pretrained = config.get("pretrained")
    if not pretrained or pretrained.startswith("random:") or not Path(pretrained).exists():
        return {}
    p = Path(pretrained)
    if p.is_dir():
        return run_config(p) or {}
    meta = read_metadata(p) if p.suffix == ".safetensors" else {}
    return json.loads(meta["config"]) if "config" in meta else {}


def _image_count(path: str | None) -> int | None:
    """How many images a local pretraining source holds; None where it is not here (or not readable)."""
    if not path or not Path(path).exists():
        return None
    from mae.data.open import open_source
    from mae.errors import MaeError

    try:
        return len(open_source(path))
    except (MaeError, OSError, TypeError):
        return None
