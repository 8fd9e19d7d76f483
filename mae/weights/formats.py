"""Checkpoint layouts of the ecosystem as pure key tables: transformers' ViTMAE and the official
facebookresearch/mae (and timm) names <-> this project's `MaskedAutoencoder` names. No files, no models: state
dicts in, state dicts out (`mae.weights.importers` locates, reads and builds)."""

from __future__ import annotations

import re

import torch

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
