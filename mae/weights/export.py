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

from mae.config import IMAGENET_MEAN, IMAGENET_STD
from mae.models.mae import MaskedAutoencoder
from mae.run_folder import ENCODER, HF_CONFIG, HF_WEIGHTS, follow_umask, run_config
from mae.version import __version__
from mae.weights.importers import CheckpointError, load_pretrained


def timm_architecture(model: MaskedAutoencoder) -> tuple[str, dict[str, Any]]:
    """(the encoder's timm architecture, the model args that make it exactly our encoder):
    `timm.create_model(name, **args)` rebuilds it."""
    enc = model.encoder
    args = {
        **model.encoder_args,
        "embed_dim": enc.embed_dim,
        "depth": len(enc.blocks),
        "num_heads": enc.blocks[0].attn.num_heads,
        "global_pool": enc.global_pool,
    }
    return model.encoder_arch, args


def describe_vit(args: dict[str, Any]) -> str:
    """A ViT in words from its model args, e.g. "ViT 192 wide, 12 blocks, patch 8, 64x64" (timm's
    architecture names fix a patch size and input that the args may change)."""
    size = args["img_size"]
    h, w = (size, size) if isinstance(size, int) else size
    return f"ViT {args['embed_dim']} wide, {args['depth']} blocks, patch {args['patch_size']}, {h}x{w}"


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


def encoder_pretrained_cfg(model: MaskedAutoencoder, config: dict[str, Any] | None) -> dict[str, Any]:
    """timm's `pretrained_cfg` of an encoder export: the model's input size, the run's normalisation
    (when no run config is known, ImageNet's: for another channel count than 3, its average in every
    channel), no classes."""
    data = (config or {}).get("data", {})
    c = model.in_chans
    default_mean, default_std = (
        (IMAGENET_MEAN, IMAGENET_STD) if c == 3 else ((sum(IMAGENET_MEAN) / 3,) * c, (sum(IMAGENET_STD) / 3,) * c)
    )
    mean, std = list(data.get("mean", default_mean)), list(data.get("std", default_std))
    return timm_pretrained_cfg([model.in_chans, *model.img_size], mean, std, 0)


def encoder_state_dict(
    model: MaskedAutoencoder, full_state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The encoder's weights with timm key names, as contiguous unshared CPU tensors; from `full_state`
    (the whole MAE's state dict, gathered from sharded training) when given, else from `model`."""
    if full_state is not None:
        state = {k[len("encoder.") :]: v for k, v in full_state.items() if k.startswith("encoder.")}
    else:
        state = model.encoder.state_dict()
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    follow_umask(tmp)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def save_encoder(
    model: MaskedAutoencoder,
    path: str | os.PathLike,
    config: dict[str, Any] | None = None,
    full_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write encoder-only safetensors (timm keys) with metadata describing it; the weights come from
    `full_state` when given (see `encoder_state_dict`)."""
    arch, args = timm_architecture(model)
    pretrained_cfg = encoder_pretrained_cfg(model, config)
    mean, std = pretrained_cfg["mean"], pretrained_cfg["std"]
    metadata = {
        "format": "pt",
        "architecture": arch,
        "model_args": json.dumps(args),
        "pretrained_cfg": json.dumps(pretrained_cfg),
        "img_size": json.dumps(args["img_size"]),
        "patch_size": str(model.patch_size),
        "num_heads": str(args["num_heads"]),
        "mean": json.dumps(mean),
        "std": json.dumps(std),
        "global_pool": args["global_pool"],
        "mae_version": __version__,
    }
    if config is not None:
        metadata["config"] = json.dumps(config)
    return _save(encoder_state_dict(model, full_state), Path(path), metadata)


def save_model(model: MaskedAutoencoder, path: str | os.PathLike) -> Path:
    """The whole MAE (encoder and decoder) as one safetensors file that `load_pretrained` reads."""
    kwargs = {
        "img_size": list(model.img_size),
        "patch_size": model.patch_size,
        "in_chans": model.in_chans,
        "num_heads": model.encoder.blocks[0].attn.num_heads,
        "decoder_num_heads": model.decoder.blocks[0].attn.num_heads if len(model.decoder.blocks) else 16,
        "mask_ratio": model.mask_ratio,
        "norm_pix_loss": model.norm_pix_loss,
        "encoder_arch": model.encoder_arch,
        "decoder": model.decoder_name,
        "predict_ratio": getattr(model.decoder, "predict_ratio", 1.0),
    }
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    return _save(
        tensors, Path(path), {"format": "pt", "mae_model_args": json.dumps(kwargs), "mae_version": __version__}
    )


def export_encoder(
    source: MaskedAutoencoder | str | os.PathLike, path: str | os.PathLike, format: str = "safetensors"
) -> Path:
    """Write `source`'s encoder (a model, an output folder or any checkpoint `load_pretrained` reads).

    format: "safetensors" (one file) or "hf-folder" (model.safetensors + timm config.json + README.md).
    """
    if format not in ("safetensors", "hf-folder"):
        raise ValueError(f"--format {format}: choose safetensors or hf-folder")
    model = source if isinstance(source, MaskedAutoencoder) else load_pretrained(source)
    config = None if isinstance(source, MaskedAutoencoder) else run_config(source)
    if format == "safetensors":
        return save_encoder(model, path, config)
    folder = Path(path)
    weights = save_encoder(model, folder / HF_WEIGHTS, config)
    arch, args = timm_architecture(model)
    pretrained_cfg = encoder_pretrained_cfg(model, config)
    hub_config = {
        "architecture": arch,
        "num_classes": 0,
        "num_features": args["embed_dim"],
        "global_pool": args["global_pool"],
        "model_args": args,
        "pretrained_cfg": pretrained_cfg,
    }
    (folder / HF_CONFIG).write_text(json.dumps(hub_config, indent=2) + "\n")
    (folder / "README.md").write_text(_model_card(arch, args, config))
    return weights.parent


def _model_card(arch: str, args: dict[str, Any], config: dict[str, Any] | None) -> str:
    source = (config or {}).get("data", {}).get("path") or "unknown data"
    epochs = (config or {}).get("loop", {}).get("epochs", "?")
    return f"""---
library_name: timm
tags: [image-feature-extraction, mae, timm]
---
# {arch} pretrained as a masked autoencoder

A ViT encoder ({args["embed_dim"]} wide, {args["depth"]} blocks, patch {args["patch_size"]},
{args["img_size"][0]}x{args["img_size"][1]} input) pretrained with the `mae` toolkit for {epochs} epochs on
{source}. It has no classifier head: use it as a feature extractor or fine-tune it.

```python
import timm
model = timm.create_model("hf-hub:USER/REPO", pretrained=True)   # or "local-dir:/path/to/this/folder"
features = model.forward_features(images)                        # [N, 1 + L, {args["embed_dim"]}]
```
"""


def load_encoder(path: str | os.PathLike, num_classes: int = 0, **timm_kwargs: Any) -> VisionTransformer:
    """A timm `VisionTransformer` with the exported weights (an export file, an hf-folder, or an
    output folder holding `encoder.safetensors`). A different `img_size` resamples the position
    embedding (timm's `resample_abs_pos_embed`); `num_classes > 0` adds a fresh head."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in (HF_WEIGHTS, ENCODER) if (p / n).is_file()), p)
    if not p.is_file():
        raise CheckpointError(f"{path}: no encoder export (.safetensors) there; run `mae export` first")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{p}: not a readable safetensors file ({e})") from None
    if "architecture" not in meta or "model_args" not in meta:
        raise CheckpointError(f"{p}: not an encoder export of this toolkit (no architecture metadata)")
    args = {**json.loads(meta["model_args"]), **timm_kwargs}
    overlay = {"file": str(p), "num_classes": 0}
    return timm.create_model(
        meta["architecture"], pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes, **args
    )


# --- encoders for downstream stages ---------------------------------------------------------------


def encoder_source(path: str, img_size: int | tuple[int, int] | None = None) -> dict[str, Any]:
    """What a downstream stage needs of `--pretrained`: {"state", "arch", "args", "mean", "std"}.

    `path` is an encoder export (file or hf-folder), an output folder, any checkpoint
    `load_pretrained` reads, or `random:PRESET` for a randomly initialised encoder (baselines).
    """
    import warnings

    from safetensors.torch import load_file

    from mae.models.registry import create_mae

    if path.startswith("random:"):
        model = create_mae(path[len("random:") :], **({"img_size": img_size} if img_size else {}))
        meta: dict[str, str] = {}
    else:
        p = Path(path)
        if p.is_dir() and (p / ENCODER).is_file():  # a finished pretraining run
            p = p / ENCODER
        elif p.is_dir() and (p / HF_CONFIG).is_file() and (p / HF_WEIGHTS).is_file():
            p = p / HF_WEIGHTS
        meta = _metadata(p) if p.is_file() and p.suffix == ".safetensors" else {}
        if "architecture" in meta and "model_args" in meta:
            args = json.loads(meta["model_args"])
            return {
                "state": load_file(str(p)),
                "arch": meta["architecture"],
                "args": args,
                "mean": json.loads(meta.get("mean", json.dumps(IMAGENET_MEAN))),
                "std": json.loads(meta.get("std", json.dumps(IMAGENET_STD))),
            }
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*encoder only.*")  # the decoder is not used here
            model = load_pretrained(path)
        config = run_config(path) or {}
        meta = {k: json.dumps(v) for k, v in config.get("data", {}).items() if k in ("mean", "std")}
    arch, args = timm_architecture(model)
    return {
        "state": encoder_state_dict(model),
        "arch": arch,
        "args": args,
        "mean": json.loads(meta.get("mean", json.dumps(IMAGENET_MEAN))),
        "std": json.loads(meta.get("std", json.dumps(IMAGENET_STD))),
    }


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError):
        return {}


def build_classifier(
    source: dict[str, Any],
    num_classes: int,
    *,
    img_size: int | tuple[int, int] | None = None,
    global_pool: str = "token",
    fc_norm: bool | None = None,
    drop_path_rate: float = 0.0,
) -> tuple[VisionTransformer, str, dict[str, Any]]:
    """A timm ViT with the encoder's weights and a fresh head; returns (model, arch, model args).

    With average pooling and `fc_norm` (timm's default for "avg", the paper's fine-tuning), the
    encoder's final norm is dropped and `fc_norm` starts fresh, as the official code does.
    A different `img_size` resamples the position embedding (timm's checkpoint filter).
    """
    import warnings

    from timm.models.vision_transformer import checkpoint_filter_fn

    if global_pool == "token" and not _has_class_token(source):
        warnings.warn(f"{source['arch']} has no class token: pooling the patch tokens' average instead", stacklevel=2)
        global_pool = "avg"
    args = {**source["args"], "global_pool": global_pool, "drop_path_rate": drop_path_rate}
    if fc_norm is not None:
        args["fc_norm"] = fc_norm
    if img_size is not None:
        args["img_size"] = [img_size, img_size] if isinstance(img_size, int) else list(img_size)
    model = timm.create_model(source["arch"], pretrained=False, num_classes=num_classes, **args)
    state = checkpoint_filter_fn(dict(source["state"]), model)
    for name in ("norm", "fc_norm"):  # norms this classifier does not have
        if isinstance(getattr(model, name), torch.nn.Identity):
            state = {k: v for k, v in state.items() if not k.startswith(f"{name}.")}
    result = model.load_state_dict(state, strict=False)
    # Fresh: the head, fc_norm, and the final norm of an encoder that had none (timm's "gap" ViTs).
    new = ("head.", "fc_norm.") + (("norm.",) if "norm.weight" not in source["state"] else ())
    fresh = [k for k in result.missing_keys if not k.startswith(new)]
    if fresh or result.unexpected_keys:
        raise CheckpointError(
            f"the encoder does not fit {source['arch']}: missing {fresh}, unexpected {result.unexpected_keys}"
        )
    if num_classes:
        torch.nn.init.zeros_(model.head.bias)
    args = {k: v for k, v in args.items() if k != "drop_path_rate"}
    return model, source["arch"], args


def _has_class_token(source: dict[str, Any]) -> bool:
    args = {k: v for k, v in source["args"].items() if k != "global_pool"}
    with torch.device("meta"):  # no memory, no init: only the structure matters
        return timm.create_model(source["arch"], pretrained=False, num_classes=0, **args).cls_token is not None


def save_classifier(
    model: VisionTransformer,
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
    included, when given the `pretrained_cfg` in its metadata (see the README)."""
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
    state = model.state_dict() if state is None else state
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    return _save(tensors, Path(path), metadata)
