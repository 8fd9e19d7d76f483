"""Weights in: `load_pretrained` reads every MAE checkpoint format of the ecosystem.

| format | recognised by | notes |
|---|---|---|
| this project's output folder / checkpoint | `config.yaml` (its model record) beside `model.safetensors` | exact |
| this project's `mae convert` file | safetensors with the model record (`mae_spec`) | exact |
| this project's encoder export | safetensors with timm keys + the model record | decoder from its sibling, else fresh |
| the same, from older versions | `mae_model_args` / encoder metadata, config.yaml's model section | inferred |
| official facebookresearch/mae `.pth` | `{"model": ...}`, `blocks.N.attn.qkv`, `decoder_*` | renamed |
| timm MAE encoders (`vit_*_224.mae`) | timm keys, no decoder | decoder fresh |
| transformers ViTMAE | `vit.embeddings.*` keys (+ `config.json`) | q/k/v fused into qkv |

This toolkit's files carry the model record (`mae.weights.record`), which builds the model exactly; the others'
architecture is inferred from the tensors and whatever metadata they have. `read_encoder` reads the same formats
(and `random:PRESET`) as the `EncoderSpec` a downstream stage builds on. The key tables are `mae.weights.formats`.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mae.errors import CheckpointError
from mae.models.encoder import EncoderSpec
from mae.models.mae import MaskedAutoencoder
from mae.models.registry import create_mae
from mae.models.spec import ModelSpec
from mae.run_folder import (
    CONFIG,
    ENCODER,
    HF_CONFIG,
    HF_WEIGHTS,
    decoder_beside,
    is_checkpoint,
    list_checkpoints,
)
from mae.weights.files import cpu_tensors, read_metadata
from mae.weights.formats import hf_vitmae_to_mae, mae_to_hf_vitmae, official_to_mae
from mae.weights.record import file_spec, read_spec
from mae.weights.unrecorded import (
    count_blocks,
    hf_hints,
    infer_model_kwargs,
    legacy_encoder_spec,
    legacy_hints,
    legacy_run_hints,
)

__all__ = ["hf_vitmae_to_mae", "load_noting_decoder", "load_pretrained", "locate_weights", "mae_to_hf_vitmae",
           "read_encoder"]  # fmt: skip


class EncoderOnlyWarning(UserWarning):
    """`load_pretrained` of a file without decoder weights: the model's decoder is freshly initialised. A category
    of its own, so a reader that needs a trained decoder (reconstructions, `mae convert`) asks for it by class."""


# --- reading files --------------------------------------------------------------------------------


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, string metadata) of a safetensors or PyTorch file; never runs pickled code."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        meta = read_metadata(path)
        return load_file(str(path)), meta
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0] if str(e) else "unsupported pickle"
        raise CheckpointError(
            f"{path}: refusing to load: it needs pickled code to run ({reason}); re-save its state dict "
            "or convert it to safetensors"
        ) from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways (KeyError, EOFError, ...)
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint, truncated or corrupt? ({e})") from None
    for key in ("model", "state_dict", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors (or {{'model': state_dict}})")
    return obj, {}


def to_mae_keys(state: dict[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Rename any known layout to ours; returns (state, format name)."""
    if any(k.startswith("vit.embeddings.") for k in state):
        return hf_vitmae_to_mae(state), "transformers"
    if "encoder.blocks.0.attn.qkv.weight" in state:
        return dict(state), "mae"
    if "blocks.0.attn.qkv.weight" in state and "patch_embed.proj.weight" in state:
        state = _drop_head(state, path)
        return official_to_mae(state), "official" if "decoder_embed.weight" in state else "timm/official encoder"
    raise CheckpointError(
        f"{path}: not a ViT MAE checkpoint: no encoder weights in it (found keys like {sorted(state)[:3]}; "
        "expected timm ViT keys such as blocks.0.attn.qkv.weight, transformers' vit.embeddings.*, or this "
        "project's encoder.*)"
    )


def _drop_head(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """A timm classifier (a fine-tuned or probed one) as an encoder: its head dropped, and its `fc_norm` (the norm of
    the pooled features, which took the final norm's place) read as the final norm; said in a warning."""
    if "head.weight" not in state:
        return state
    out = {k: v for k, v in state.items() if not k.startswith("head.")}
    note = "its classifier head is dropped"
    if "norm.weight" not in out and "fc_norm.weight" in out:
        out = {("norm." + k[len("fc_norm.") :] if k.startswith("fc_norm.") else k): v for k, v in out.items()}
        note += " and its fc_norm serves as the encoder's final norm"
    warnings.warn(f"{path} is a classifier: {note}; the encoder is kept", stacklevel=4)  # load_pretrained's caller
    return out


def _find_weights(folder: Path) -> Path:
    for name in (HF_WEIGHTS, ENCODER, "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder}: no model.safetensors, encoder.safetensors or pytorch_model.bin in it")


def locate_weights(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(the weights file `load_pretrained` reads for `path`, what is said of the model beside it: `{"spec": record}`
    for this toolkit's runs and folders, else architecture hints): a run folder's latest checkpoint, a checkpoint, an
    hf folder's weights, or the file itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    beside: dict[str, Any] = {}
    if p.is_dir():
        ckpts = list_checkpoints(p) if not is_checkpoint(p) else []
        if ckpts:
            p = ckpts[-1]
        spec = read_spec(p)
        if spec is not None:
            beside["spec"] = spec
        elif is_checkpoint(p):
            beside.update(legacy_run_hints(p / CONFIG))
        elif (p / HF_CONFIG).exists():
            beside.update(hf_hints(p / HF_CONFIG))
        p = _find_weights(p)
    elif p.name == HF_WEIGHTS and (p.parent / HF_CONFIG).exists() and read_spec(p.parent) is None:
        beside.update(hf_hints(p.parent / HF_CONFIG))
    return p, beside


def load_pretrained(path: str | os.PathLike, **overrides: Any) -> MaskedAutoencoder:
    """A `MaskedAutoencoder` from any format in this module's table.

    This toolkit's files build from their model record; others' architecture comes from the tensors and any
    metadata. `overrides` (`create_mae`'s names, e.g. `num_heads`, `decoder_num_heads`, `norm_pix_loss`, `img_size`,
    `in_chans`, `mean`, `std`) supply or replace the rest: a different `img_size` rebuilds the fixed position tables,
    a different `in_chans` adapts the patch embedding. The shape of the weights themselves (patch size, widths,
    depths) cannot be overridden. An encoder-only file gets a freshly initialised decoder, with a warning.
    """
    p, beside = locate_weights(path)
    raw, meta = read_tensors(p)
    state, fmt = to_mae_keys(raw, p)
    spec = beside.pop("spec", None) or file_spec(meta, p)
    decoder, decoder_spec, decoder_hints = _decoder_beside(p, state)
    state = {**state, **decoder}
    if decoder_spec is not None:  # the decoder file's record describes its weights; the statistics are the encoder's
        spec = decoder_spec if spec is None else replace(decoder_spec, mean=spec.mean, std=spec.std)
    _check_fixed(state, overrides, p)
    if spec is not None:  # the record builds the model
        kwargs = {**spec.model_args(), **{k: v for k, v in overrides.items() if v is not None}}
    else:
        hints = {**beside, **legacy_hints(meta), **decoder_hints, **overrides}
        kwargs = infer_model_kwargs(state, hints, p)
    return _build(kwargs, state, fmt, p)


def _check_fixed(state: dict[str, torch.Tensor], overrides: dict[str, Any], p: Path) -> None:
    """The options that the weights' own shapes fix must agree with them."""
    proj = state["encoder.patch_embed.proj.weight"]  # [D, C, p, p]: what the tensors themselves fix
    stored = {"patch_size": proj.shape[-1], "embed_dim": proj.shape[0], "depth": count_blocks(state, "encoder.blocks.")}
    for name in ("patch_size", "embed_dim", "depth"):
        if overrides.get(name) is not None and overrides[name] != stored[name]:
            raise CheckpointError(
                f"{p}: its weights have {name} {stored[name]}, not the {overrides[name]} asked for; drop that option "
                f"or set it to {stored[name]}"
            )


def _build(kwargs: dict[str, Any], state: dict[str, torch.Tensor], fmt: str, p: Path) -> MaskedAutoencoder:
    """The model `kwargs` describe, with `state` loaded (position tables rebuilt, channels adapted)."""
    has_decoder = any(k.startswith("decoder.") for k in state)  # any registered decoder's weights
    try:
        model = MaskedAutoencoder(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:  # timm asserts, e.g. a width its head count does not divide
        raise CheckpointError(f"{p}: cannot build the model it describes ({e})") from None
    if model.grid_size != _grid_of(state):  # fixed sine-cosine tables: rebuild, never resample
        state = {k: v for k, v in state.items() if not k.endswith("pos_embed")}
    state, fresh = _adapt_channels(state, model.in_chans, p)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape the options changed (e.g. a decoder width)
        reason = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise CheckpointError(f"{p}: the weights do not fit the model the options describe ({reason})") from None
    # Position embeddings are fixed tables, and an encoder-only file leaves the decoder to its init.
    missing = [
        k
        for k in result.missing_keys
        if not k.endswith("pos_embed") and (has_decoder or not k.startswith("decoder.")) and k not in fresh
    ]
    if result.unexpected_keys or missing:
        raise CheckpointError(
            f"{p}: does not fit the architecture inferred from it ({fmt}); missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    if not has_decoder:
        warnings.warn(f"{p} holds an encoder only ({fmt}); the decoder is freshly initialised", EncoderOnlyWarning, 3)
    return model


def load_noting_decoder(path: str | os.PathLike, **overrides: Any) -> tuple[MaskedAutoencoder, bool]:
    """(`load_pretrained(path, **overrides)`, whether the file held decoder weights): for the readers that must not
    take a freshly initialised decoder for a trained one. Its `EncoderOnlyWarning` is answered by the flag; others
    pass on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_pretrained(path, **overrides)
    for w in caught:
        if not issubclass(w.category, EncoderOnlyWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model, not any(issubclass(w.category, EncoderOnlyWarning) for w in caught)


def _decoder_beside(
    path: Path, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], ModelSpec | None, dict[str, Any]]:
    """(the decoder an encoder export carries in its sibling file (`save_decoder`), that file's model record, what an
    older one's `mae_model_args` say instead); ({}, None, {}) when `path` holds a decoder itself or has no sibling."""
    sibling = decoder_beside(path)
    if any(k.startswith("decoder.") for k in state) or path.suffix != ".safetensors" or not sibling.is_file():
        return {}, None, {}
    decoder, meta = read_tensors(sibling)
    spec = file_spec(meta, sibling)
    if not (spec or "mae_model_args" in meta) or not all(k.startswith("decoder.") for k in decoder):
        raise CheckpointError(f"{sibling}: not a decoder export of this toolkit (no model record in its metadata)")
    return decoder, spec, legacy_hints(meta)


def _adapt_channels(
    state: dict[str, torch.Tensor], in_chans: int, path: Path
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Weights for another channel count (e.g. RGB weights for a grayscale or multispectral model): the patch
    embedding adapted as timm's `adapt_input_conv` does (summed for 1 channel, repeated and rescaled for
    more), the decoder's pixel head (whose outputs are per channel) left to its initialisation; warned.
    Returns (state, the keys left fresh)."""
    key = "encoder.patch_embed.proj.weight"
    stored = state[key].shape[1]
    if stored == in_chans:
        return state, set()
    from timm.models import adapt_input_conv

    state = {**state, key: adapt_input_conv(in_chans, state[key], base_chans=stored)}
    fresh = {k for k in state if k.startswith("decoder.pred.")}
    warnings.warn(
        f"{path}: {stored}-channel weights adapted to {in_chans} channels (patch embedding as timm's "
        "adapt_input_conv; the decoder's pixel head starts fresh)",
        stacklevel=4,  # load_pretrained's caller
    )
    return {k: v for k, v in state.items() if k not in fresh}, fresh


def _grid_of(state: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    length = state["encoder.pos_embed"].shape[1] - 1 if "encoder.pos_embed" in state else None
    side = round(length**0.5) if length else 0
    return (side, side) if side * side == length else None


# --- encoders for downstream stages ---------------------------------------------------------------


def read_encoder(path: str, img_size: int | tuple[int, int] | None = None, seed: int = 0) -> EncoderSpec:
    """What a downstream stage needs of `--pretrained`: the encoder's weights, architecture and model record.

    `path` is an encoder export (file or hf-folder), an output folder, any checkpoint `load_pretrained`
    reads, or `random:PRESET` for a randomly initialised encoder (baselines; the same `seed` gives the same
    weights, whatever the global random state). Statistics follow the record's rule (`ModelSpec.input_stats`):
    unrecorded, they are ImageNet's for 3 channels and unknown (None) for any other channel count.
    """
    if path.startswith("random:"):
        with torch.random.fork_rng(devices=[]):  # the caller's random stream stays untouched
            torch.manual_seed(seed)
            model = create_mae(path[len("random:") :], **({"img_size": img_size} if img_size else {}))
        return encoder_of(model)
    p = Path(path)
    if p.is_dir() and (p / ENCODER).is_file():  # a finished pretraining run
        p = p / ENCODER
    elif p.is_dir() and (p / HF_CONFIG).is_file() and (p / HF_WEIGHTS).is_file():
        p = p / HF_WEIGHTS
    meta = read_metadata(p) if p.is_file() and p.suffix == ".safetensors" else {}
    if "architecture" in meta and "model_args" in meta:  # timm's own keys and args: read as they are
        from safetensors.torch import load_file

        args = json.loads(meta["model_args"])
        record = file_spec(meta, p) or legacy_encoder_spec(meta["architecture"], args, legacy_hints(meta))
        return _encoder_spec(meta["architecture"], args, load_file(str(p)), record)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*encoder only.*")  # the decoder is not used here
        model = load_pretrained(path)
    return encoder_of(model)


def encoder_of(model: MaskedAutoencoder) -> EncoderSpec:
    """The encoder of a `MaskedAutoencoder` as a downstream stage receives it."""
    arch, args = model.adapter.timm_architecture()
    return _encoder_spec(arch, args, cpu_tensors(model.encoder.state_dict()), model.spec)


def _encoder_spec(arch: str, args: dict[str, Any], state: dict[str, torch.Tensor], record: ModelSpec) -> EncoderSpec:
    args = {k: v for k, v in args.items() if k != "num_classes"}  # a classifier read as an encoder
    stats = record.input_stats()
    mean, std = stats if stats is not None else (None, None)
    return EncoderSpec(arch=arch, args=args, state=state, mean=mean, std=std, record=record)
