"""Weights in: `load_pretrained` reads every MAE checkpoint format of the ecosystem.

| format | recognised by | notes |
|---|---|---|
| this project's output folder / checkpoint | `config.yaml` beside `model.safetensors` | exact |
| this project's `mae convert` file | safetensors with `mae_model_args` metadata | exact |
| this project's encoder export | safetensors with timm keys + metadata | decoder from its sibling, else fresh |
| official facebookresearch/mae `.pth` | `{"model": ...}`, `blocks.N.attn.qkv`, `decoder_*` | renamed |
| timm MAE encoders (`vit_*_224.mae`) | timm keys, no decoder | decoder fresh |
| transformers ViTMAE | `vit.embeddings.*` keys (+ `config.json`) | q/k/v fused into qkv |

`read_encoder` reads the same formats (and `random:PRESET`) as the `EncoderSpec` a downstream stage builds on.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from mae.config import IMAGENET_MEAN, IMAGENET_STD
from mae.errors import CheckpointError
from mae.models.encoder import EncoderSpec
from mae.models.mae import MaskedAutoencoder
from mae.models.registry import create_mae, preset_config, preset_matching
from mae.run_folder import (
    CONFIG,
    ENCODER,
    HF_CONFIG,
    HF_WEIGHTS,
    decoder_beside,
    is_checkpoint,
    list_checkpoints,
    run_config,
)
from mae.weights.files import cpu_tensors, read_metadata

# transformers' ViTMAE (4.x `encoder.layer.N.attention.attention.query` and 5.x in-memory
# `layers.N.attention.q_proj` spellings) -> this project's names. Attention q/k/v are fused below.
_HF_RULES: list[tuple[str, str]] = [
    (r"^vit\.embeddings\.cls_token$", "encoder.cls_token"),
    (r"^vit\.embeddings\.position_embeddings$", "encoder.pos_embed"),
    (r"^vit\.embeddings\.patch_embeddings\.projection\.", "encoder.patch_embed.proj."),
    (r"^vit\.(?:encoder\.layer|layers)\.(\d+)\.", r"encoder.blocks.\1."),
    (r"^vit\.layernorm\.", "encoder.norm."),
    (r"^decoder\.decoder_embed\.", "decoder.embed."),
    (r"^decoder\.mask_token$", "decoder.mask_token"),
    (r"^decoder\.decoder_pos_embed$", "decoder.pos_embed"),
    # 4.x `decoder_layers.N`; what 5.x's save_pretrained writes: `decoder_encoder.layer.N`
    (r"^decoder\.(?:decoder_layers|decoder_encoder\.layer)\.(\d+)\.", r"decoder.blocks.\1."),
    (r"^decoder\.decoder_norm\.", "decoder.norm."),
    (r"^decoder\.decoder_pred\.", "decoder.pred."),
]
_HF_BLOCK_RULES: list[tuple[str, str]] = [
    (r"\.attention\.(?:attention\.)?(?:query|q_proj)\.", ".attn.q."),
    (r"\.attention\.(?:attention\.)?(?:key|k_proj)\.", ".attn.k."),
    (r"\.attention\.(?:attention\.)?(?:value|v_proj)\.", ".attn.v."),
    (r"\.attention\.(?:output\.dense|o_proj)\.", ".attn.proj."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]


class EncoderOnlyWarning(UserWarning):
    """`load_pretrained` of a file without decoder weights: the model's decoder is freshly initialised. A category
    of its own, so a reader that needs a trained decoder (reconstructions, `mae convert`) asks for it by class."""


def _rename(key: str, rules: list[tuple[str, str]]) -> str:
    for pattern, repl in rules:
        key = re.sub(pattern, repl, key)
    return key


def _fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate separate `attn.q/k/v` tensors into timm's fused `attn.qkv` ([q; k; v])."""
    out = {}
    for key, value in state.items():
        m = re.match(r"(.*\.attn\.)([qkv])\.(weight|bias)$", key)
        if m is None:
            out[key] = value
        elif m.group(2) == "q":
            prefix, kind = m.group(1), m.group(3)
            parts = [state[f"{prefix}{c}.{kind}"] for c in "qkv"]
            out[f"{prefix}qkv.{kind}"] = torch.cat(parts, dim=0)
    return out


def _split_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_fuse_qkv`."""
    out = {}
    for key, value in state.items():
        m = re.match(r"(.*\.attn\.)qkv\.(weight|bias)$", key)
        if m is None:
            out[key] = value
            continue
        for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
            out[f"{m.group(1)}{name}.{m.group(2)}"] = part
    return out


def hf_vitmae_to_mae(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers `ViTMAEForPreTraining` state dict -> `MaskedAutoencoder` keys.

    transformers stores the sine-cosine tables in the same channel order as the official code
    (it builds the canonical [h | w] table and swaps the halves), so they copy unchanged.
    """
    renamed = {}
    for key, value in state.items():
        new = _rename(key, _HF_RULES)
        if new.startswith(("encoder.blocks.", "decoder.blocks.")):
            new = _rename(new, _HF_BLOCK_RULES)
        renamed[new] = value
    return _fuse_qkv(renamed)


def mae_to_hf_vitmae(state: dict[str, torch.Tensor], *, layout: str = "v5") -> dict[str, torch.Tensor]:
    """`MaskedAutoencoder` keys -> transformers `ViTMAEForPreTraining` (`layout` "v5" or "v4")."""
    if layout not in ("v4", "v5"):
        raise ValueError(f"layout must be 'v4' or 'v5', got {layout!r}")
    v5 = layout == "v5"
    block = {
        "attn.q.": "attention.q_proj." if v5 else "attention.attention.query.",
        "attn.k.": "attention.k_proj." if v5 else "attention.attention.key.",
        "attn.v.": "attention.v_proj." if v5 else "attention.attention.value.",
        "attn.proj.": "attention.o_proj." if v5 else "attention.output.dense.",
        "norm1.": "layernorm_before.",
        "norm2.": "layernorm_after.",
        "mlp.fc1.": "mlp.fc1." if v5 else "intermediate.dense.",
        "mlp.fc2.": "mlp.fc2." if v5 else "output.dense.",
    }
    top = {
        "encoder.cls_token": "vit.embeddings.cls_token",
        "encoder.pos_embed": "vit.embeddings.position_embeddings",
        "encoder.patch_embed.proj.": "vit.embeddings.patch_embeddings.projection.",
        "encoder.norm.": "vit.layernorm.",
        "decoder.embed.": "decoder.decoder_embed.",
        "decoder.mask_token": "decoder.mask_token",
        "decoder.pos_embed": "decoder.decoder_pos_embed",
        "decoder.norm.": "decoder.decoder_norm.",
        "decoder.pred.": "decoder.decoder_pred.",
    }
    out = {}
    for key, value in _split_qkv(state).items():
        m = re.match(r"(encoder|decoder)\.blocks\.(\d+)\.(.*)$", key)
        if m:
            prefix = (
                ("vit.layers." if v5 else "vit.encoder.layer.")
                if m.group(1) == "encoder"
                else ("decoder.decoder_layers.")
            )
            rest = m.group(3)
            for src, dst in block.items():
                if rest.startswith(src):
                    rest = dst + rest[len(src) :]
                    break
            out[f"{prefix}{m.group(2)}.{rest}"] = value
            continue
        for src, dst in top.items():
            if key.startswith(src):
                out[dst + key[len(src) :]] = value
                break
        else:
            raise KeyError(f"no transformers name for parameter '{key}'")
    return out


# --- the official facebookresearch/mae layout ----------------------------------------------------
# Encoder keys are timm's (`cls_token`, `pos_embed`, `patch_embed.*`, `blocks.N.*`, `norm.*`);
# the decoder lives at the top level with a `decoder_` prefix and one `mask_token`.
_OFFICIAL_DECODER = [
    ("mask_token", "decoder.mask_token"),
    ("decoder_embed.", "decoder.embed."),
    ("decoder_pos_embed", "decoder.pos_embed"),
    ("decoder_blocks.", "decoder.blocks."),
    ("decoder_norm.", "decoder.norm."),
    ("decoder_pred.", "decoder.pred."),
]


def official_to_mae(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An official (or timm) MAE state dict -> `MaskedAutoencoder` keys."""
    out = {}
    for key, value in state.items():
        for src, dst in _OFFICIAL_DECODER:
            if key == src or (src.endswith(".") and key.startswith(src)):
                out[dst + key[len(src) :]] = value
                break
        else:
            out[f"encoder.{key}"] = value
    return out


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
    warnings.warn(f"{path} is a classifier: {note}; the encoder is kept", stacklevel=3)
    return out


def _count(state: dict[str, torch.Tensor], prefix: str) -> int:
    idx = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def infer_model_kwargs(state: dict[str, torch.Tensor], hints: dict[str, Any], path: Path) -> dict[str, Any]:
    """`MaskedAutoencoder` arguments from tensor shapes; `hints` (metadata, overrides) win."""
    proj = state["encoder.patch_embed.proj.weight"]  # [D, C, p, p]
    embed_dim, in_chans, patch = proj.shape[0], proj.shape[1], proj.shape[-1]
    kw: dict[str, Any] = {
        "embed_dim": embed_dim,
        "in_chans": in_chans,
        "patch_size": patch,
        "depth": _count(state, "encoder.blocks."),
        "mlp_ratio": state["encoder.blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
    }
    length = state["encoder.pos_embed"].shape[1] - 1
    side = round(length**0.5)
    if "img_size" not in hints and side * side != length:
        raise CheckpointError(f"{path}: {length} patches are not a square grid; pass img_size=(H, W)")
    kw["img_size"] = side * patch
    preset = preset_matching(embed_dim=embed_dim) or {}
    kw["num_heads"] = preset.get("num_heads")
    kw["encoder_arch"] = preset.get("encoder_arch", "vit_base_patch16_224")
    if "decoder.embed.weight" in state:
        dec = state["decoder.embed.weight"].shape[0]
        kw.update(decoder_embed_dim=dec, decoder_depth=_count(state, "decoder.blocks."), decoder_num_heads=dec // 32)
        if "decoder.blocks.0.mlp.fc1.weight" in state:
            kw["decoder_mlp_ratio"] = state["decoder.blocks.0.mlp.fc1.weight"].shape[0] / dec
    kw.update({k: v for k, v in hints.items() if v is not None})
    if kw["num_heads"] is None:
        raise CheckpointError(f"{path}: cannot tell the head count of a {embed_dim}-wide ViT; pass num_heads=")
    if isinstance(kw["img_size"], list):
        kw["img_size"] = tuple(kw["img_size"])
    return kw


def _hf_hints(config_file: Path) -> dict[str, Any]:
    c = json.loads(config_file.read_text())
    return {
        "num_heads": c.get("num_attention_heads"),
        "decoder_num_heads": c.get("decoder_num_attention_heads"),
        "img_size": c.get("image_size"),
        "norm_pix_loss": c.get("norm_pix_loss"),
        "mask_ratio": c.get("mask_ratio"),
    }


def _metadata_hints(meta: dict[str, str]) -> dict[str, Any]:
    if "mae_model_args" in meta:
        return json.loads(meta["mae_model_args"])
    hints: dict[str, Any] = {}
    if "num_heads" in meta:
        hints["num_heads"] = int(meta["num_heads"])
    if "img_size" in meta:
        hints["img_size"] = json.loads(meta["img_size"])
    return hints


def _find_weights(folder: Path) -> Path:
    for name in (HF_WEIGHTS, ENCODER, "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder}: no model.safetensors, encoder.safetensors or pytorch_model.bin in it")


def locate_weights(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(the weights file `load_pretrained` reads for `path`, the architecture hints found beside it): a run folder's
    latest checkpoint, a checkpoint, an hf folder's weights, or the file itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or folder")
    hints: dict[str, Any] = {}
    if p.is_dir():
        ckpts = list_checkpoints(p) if not is_checkpoint(p) else []
        if ckpts:
            p = ckpts[-1]
        if is_checkpoint(p):
            hints.update(_run_hints(p / CONFIG))
        elif (p / HF_CONFIG).exists():
            hints.update(_hf_hints(p / HF_CONFIG))
        p = _find_weights(p)
    elif p.name == HF_WEIGHTS and (p.parent / HF_CONFIG).exists():
        hints.update(_hf_hints(p.parent / HF_CONFIG))
    return p, hints


def load_pretrained(path: str | os.PathLike, **overrides: Any) -> MaskedAutoencoder:
    """A `MaskedAutoencoder` from any format in this module's table.

    The architecture comes from the tensors and any metadata; `overrides` (`create_mae`'s names,
    e.g. `num_heads`, `decoder_num_heads`, `norm_pix_loss`, `img_size`, `in_chans`) supply or replace the rest: a
    different `img_size` rebuilds the fixed position tables, a different `in_chans` adapts the patch embedding.
    The shape of the weights themselves (patch size, widths, depths) cannot be overridden. An encoder-only file
    gets a freshly initialised decoder, with a warning.
    """
    p, hints = locate_weights(path)
    raw, meta = read_tensors(p)
    state, fmt = to_mae_keys(raw, p)
    hints.update(_metadata_hints(meta))
    state = {**state, **_decoder_beside(p, state, hints)}
    proj = state["encoder.patch_embed.proj.weight"]  # [D, C, p, p]: what the tensors themselves fix
    stored = {"patch_size": proj.shape[-1], "embed_dim": proj.shape[0], "depth": _count(state, "encoder.blocks.")}
    for name in ("patch_size", "embed_dim", "depth"):
        if overrides.get(name) is not None and overrides[name] != stored[name]:
            raise CheckpointError(
                f"{p}: its weights have {name} {stored[name]}, not the {overrides[name]} asked for; drop that option "
                f"or set it to {stored[name]}"
            )
    hints.update(overrides)
    kwargs = infer_model_kwargs(state, hints, p)
    has_decoder = any(k.startswith("decoder.") for k in state)  # any registered decoder's weights
    try:
        model = MaskedAutoencoder(**kwargs)
    except (TypeError, ValueError) as e:
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
        warnings.warn(f"{p} holds an encoder only ({fmt}); the decoder is freshly initialised", EncoderOnlyWarning, 2)
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


def _decoder_beside(path: Path, state: dict[str, torch.Tensor], hints: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The decoder an encoder export carries in its sibling file (`save_decoder`), its model args added to
    `hints`; {} when `path` holds a decoder itself or has no sibling."""
    sibling = decoder_beside(path)
    if any(k.startswith("decoder.") for k in state) or path.suffix != ".safetensors" or not sibling.is_file():
        return {}
    decoder, meta = read_tensors(sibling)
    if "mae_model_args" not in meta or not all(k.startswith("decoder.") for k in decoder):
        raise CheckpointError(f"{sibling}: not a decoder export of this toolkit (no mae_model_args metadata)")
    hints.update(json.loads(meta["mae_model_args"]))
    return decoder


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
        stacklevel=3,
    )
    return {k: v for k, v in state.items() if k not in fresh}, fresh


def _grid_of(state: dict[str, torch.Tensor]) -> tuple[int, int] | None:
    length = state["encoder.pos_embed"].shape[1] - 1 if "encoder.pos_embed" in state else None
    side = round(length**0.5) if length else 0
    return (side, side) if side * side == length else None


def _run_hints(config_yaml: Path) -> dict[str, Any]:
    import yaml

    m = yaml.safe_load(config_yaml.read_text())["model"]
    hints = {k: v for k, v in preset_config(m["name"]).items() if k == "encoder_arch" or k.endswith("num_heads")}
    hints.update({k: m[k] for k in ("num_heads", "decoder_num_heads") if m.get(k) is not None})
    hints.update(img_size=m["img_size"], mask_ratio=m["mask_ratio"], norm_pix_loss=m["norm_pix_loss"])
    hints.update({k: m[k] for k in ("decoder", "predict_ratio") if k in m})
    return hints


# --- encoders for downstream stages ---------------------------------------------------------------


def read_encoder(path: str, img_size: int | tuple[int, int] | None = None, seed: int = 0) -> EncoderSpec:
    """What a downstream stage needs of `--pretrained`: the encoder's weights, architecture and statistics.

    `path` is an encoder export (file or hf-folder), an output folder, any checkpoint `load_pretrained`
    reads, or `random:PRESET` for a randomly initialised encoder (baselines; the same `seed` gives the same
    weights, whatever the global random state). Statistics not recorded with the weights are ImageNet's.
    """
    if path.startswith("random:"):
        with torch.random.fork_rng(devices=[]):  # the caller's random stream stays untouched
            torch.manual_seed(seed)
            model = create_mae(path[len("random:") :], **({"img_size": img_size} if img_size else {}))
        return _spec(model, {})
    p = Path(path)
    if p.is_dir() and (p / ENCODER).is_file():  # a finished pretraining run
        p = p / ENCODER
    elif p.is_dir() and (p / HF_CONFIG).is_file() and (p / HF_WEIGHTS).is_file():
        p = p / HF_WEIGHTS
    meta = read_metadata(p) if p.is_file() and p.suffix == ".safetensors" else {}
    if "architecture" in meta and "model_args" in meta:
        from safetensors.torch import load_file

        stats = {k: json.loads(meta[k]) for k in ("mean", "std") if k in meta}
        return EncoderSpec(
            arch=meta["architecture"],
            args=json.loads(meta["model_args"]),
            state=load_file(str(p)),
            mean=tuple(stats.get("mean", IMAGENET_MEAN)),
            std=tuple(stats.get("std", IMAGENET_STD)),
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*encoder only.*")  # the decoder is not used here
        model = load_pretrained(path)
    data = (run_config(path) or {}).get("data", {})
    return _spec(model, {k: data[k] for k in ("mean", "std") if k in data})


def _spec(model: MaskedAutoencoder, stats: dict[str, Any]) -> EncoderSpec:
    arch, args = model.adapter.timm_architecture()
    return EncoderSpec(
        arch=arch,
        args=args,
        state=cpu_tensors(model.encoder.state_dict()),
        mean=tuple(stats.get("mean", IMAGENET_MEAN)),
        std=tuple(stats.get("std", IMAGENET_STD)),
    )
