"""Weights out: the encoder as safetensors with timm key names, loadable by timm anywhere.

`export_encoder` writes the encoder alone (no decoder, no mask token: timm's checkpoint filter
reads a top-level `mask_token` as a DINOv2 checkpoint) with string metadata saying what it is;
`--format hf-folder` adds timm's `config.json` and a model card, the layout `timm.create_model`
reads from `hf-hub:` and `local-dir:`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from mae.errors import CheckpointError
from mae.models.mae import MaskedAutoencoder
from mae.models.spec import ModelSpec, with_spec
from mae.run_folder import ENCODER, HF_CONFIG, HF_WEIGHTS, decoder_beside, run_config
from mae.version import __version__
from mae.weights.card import model_card
from mae.weights.files import cpu_tensors, read_metadata, write_safetensors
from mae.weights.importers import load_noting_decoder
from mae.weights.record import spec_metadata


def timm_pretrained_cfg(
    input_size: list[int], mean: list[float], std: list[float], num_classes: int, crop_pct: float = 0.875
) -> dict[str, Any]:
    """timm's `pretrained_cfg` for an export: what `timm.data.resolve_data_config` reads (input size,
    normalisation, crop), and the class count that tells timm to keep a trained head."""
    return {
        "tag": "mae",
        "input_size": list(input_size),
        "fixed_input_size": True,
        "interpolation": "bicubic",
        "crop_pct": crop_pct,
        "crop_mode": "center",
        "mean": list(mean),
        "std": list(std),
        "num_classes": num_classes,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }


def encoder_pretrained_cfg(model: MaskedAutoencoder) -> dict[str, Any]:
    """timm's `pretrained_cfg` of an encoder export: the model's input size and normalisation (the record's rule
    for unrecorded statistics, `ModelSpec.input_stats`), no classes."""
    return timm_pretrained_cfg([model.in_chans, *model.img_size], *model_stats(model.spec), 0)


def model_stats(spec: ModelSpec) -> tuple[list[float], list[float]]:
    """(mean, std) of a model that is written out; CheckpointError when its channel count has no default."""
    stats = spec.input_stats()
    if stats is None:
        raise CheckpointError(
            f"the model's normalisation for its {spec.in_chans} channels was never recorded; record it first "
            "(model.record_stats(mean, std), or pretrain with --data.mean/--data.std or auto)"
        )
    return list(stats[0]), list(stats[1])


def encoder_state_dict(
    model: MaskedAutoencoder, full_state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The encoder's weights with timm key names, as contiguous unshared CPU tensors; from `full_state`
    (the whole MAE's state dict, gathered from sharded training) when given, else from `model`."""
    if full_state is not None:
        state = {k[len("encoder.") :]: v for k, v in full_state.items() if k.startswith("encoder.")}
    else:
        state = model.encoder.state_dict()
    return cpu_tensors(state)


def save_encoder(
    model: MaskedAutoencoder,
    path: str | os.PathLike,
    config: dict[str, Any] | None = None,
    full_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write encoder-only safetensors (timm keys) with metadata describing it; the weights come from
    `full_state` when given (see `encoder_state_dict`)."""
    arch, args = model.adapter.timm_architecture()
    metadata = {
        "format": "pt",
        "architecture": arch,  # what timm (`load_encoder`) reads; the record is ours
        "model_args": json.dumps(args),
        "pretrained_cfg": json.dumps(encoder_pretrained_cfg(model)),
        **spec_metadata(model.spec),
        "mae_version": __version__,
    }
    if config is not None:
        metadata["config"] = json.dumps(config)
    return write_safetensors(encoder_state_dict(model, full_state), path, metadata)


def save_model(model: MaskedAutoencoder, path: str | os.PathLike) -> Path:
    """The whole MAE (encoder and decoder) as one safetensors file that `load_pretrained` reads."""
    metadata = {"format": "pt", **spec_metadata(model.spec), "mae_version": __version__}
    return write_safetensors(cpu_tensors(model.state_dict()), path, metadata)


def save_decoder(
    model: MaskedAutoencoder, path: str | os.PathLike, full_state: dict[str, torch.Tensor] | None = None
) -> Path:
    """The decoder alone (`decoder.` keys, as in the MAE's state dict, and the model record), for
    `decoder_beside(encoder_file)`, where `load_pretrained` of the encoder export finds it; from `full_state`
    when given (see `encoder_state_dict`)."""
    state = model.state_dict() if full_state is None else full_state
    decoder = {k: v for k, v in state.items() if k.startswith("decoder.")}
    metadata = {"format": "pt", **spec_metadata(model.spec), "mae_version": __version__}
    return write_safetensors(cpu_tensors(decoder), path, metadata)


def export_encoder(
    source: MaskedAutoencoder | str | os.PathLike,
    path: str | os.PathLike,
    format: str = "safetensors",
    *,
    with_decoder: bool = False,
    license: str = "apache-2.0",
) -> Path:
    """Write `source`'s encoder (a model, an output folder or any checkpoint `load_pretrained` reads).

    format: "safetensors" (one file) or "hf-folder" (model.safetensors + timm config.json + README.md).
    with_decoder: also write the decoder beside it (`decoder_beside`: `NAME.decoder.safetensors`, or
    `decoder.safetensors` in the folder), which `load_pretrained` of the export reads back; timm ignores it.
    """
    if format not in ("safetensors", "hf-folder"):
        raise ValueError(f"--format {format}: choose safetensors or hf-folder")
    model, has_decoder = (source, True) if isinstance(source, MaskedAutoencoder) else load_noting_decoder(source)
    if with_decoder and not has_decoder:  # a fresh decoder written beside it would be read back as a trained one
        raise CheckpointError(f"{source}: holds no trained decoder to write beside the encoder; drop --with_decoder")
    config = None if isinstance(source, MaskedAutoencoder) else run_config(source)
    # Written by hand, not with timm's `save_for_hf`: that writes model.safetensors without the metadata
    # `load_encoder` and `read_encoder` read, and its config.json changes across the timm 1.0.x we accept.
    weights = Path(path) / HF_WEIGHTS if format == "hf-folder" else Path(path)
    save_encoder(model, weights, config)
    if with_decoder:
        save_decoder(model, decoder_beside(weights))
    if format == "safetensors":
        return weights
    arch, args = model.adapter.timm_architecture()
    write_hf_config(weights.parent, arch, args, encoder_pretrained_cfg(model), spec=model.spec)
    run_dir = source if not isinstance(source, MaskedAutoencoder) and Path(source).is_dir() else None
    card = model_card(model.encoder, config=config, run_dir=run_dir, license=license, with_decoder=with_decoder)
    (weights.parent / "README.md").write_text(card)
    return weights.parent


def write_hf_config(
    folder: Path,
    arch: str,
    args: dict[str, Any],
    pretrained_cfg: dict[str, Any],
    label_names: list[str] | None = None,
    spec: ModelSpec | None = None,
) -> Path:
    """timm's config.json of an hf folder (what `timm.create_model("hf-hub:..." / "local-dir:...")` reads):
    the architecture and its model args, the run's own input size and normalisation, and a classifier's
    `label_names` (top level, as timm's `save_for_hf` writes them)."""
    num_classes = len(label_names or [])
    hub_config = {
        "architecture": arch,
        "num_classes": num_classes,
        "num_features": args["embed_dim"],
        "global_pool": args["global_pool"],
        "model_args": {k: v for k, v in args.items() if k != "num_classes"},
        "pretrained_cfg": {**pretrained_cfg, "num_classes": num_classes},
    }
    if label_names:
        hub_config["label_names"] = list(label_names)
    path = folder / HF_CONFIG
    path.write_text(json.dumps(with_spec(hub_config, spec), indent=2) + "\n")
    return path


def load_encoder(path: str | os.PathLike, num_classes: int = 0, **timm_kwargs: Any) -> VisionTransformer:
    """A timm `VisionTransformer` with the exported weights (an export file, an hf-folder, or an
    output folder holding `encoder.safetensors`). A different `img_size` resamples the position
    embedding (timm's `resample_abs_pos_embed`); `num_classes > 0` adds a fresh head."""
    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in (HF_WEIGHTS, ENCODER) if (p / n).is_file()), p)
    if not p.is_file():
        raise CheckpointError(f"{path}: no encoder export (.safetensors) there; run `mae export` first")
    meta = read_metadata(p)
    if "architecture" not in meta or "model_args" not in meta:
        raise CheckpointError(f"{p}: not an encoder export of this toolkit (no architecture metadata)")
    args = {**json.loads(meta["model_args"]), **timm_kwargs}
    overlay = {"file": str(p), "num_classes": 0}
    return timm.create_model(
        meta["architecture"], pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes, **args
    )
