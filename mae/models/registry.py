"""Named architectures and the one factory, `create_mae`.

Names follow timm and the official code: `mae_vit_{size}_patch{p}` with the decoder spelled out
in the long form (`_dec512d8b` = 512 wide, 8 blocks).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from mae.models.mae import MaskedAutoencoder
from mae.registry import Registry

_PRESETS: Registry[dict[str, Any]] = Registry("preset")


def register_preset(name: str, *, aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
    """Add a preset: `kwargs` are `MaskedAutoencoder` arguments."""
    _PRESETS.register(name, kwargs, aliases=aliases)


def list_presets(include_aliases: bool = False) -> list[str]:
    """The preset names `create_mae` accepts."""
    return sorted(_PRESETS.names()) + (sorted(_PRESETS.aliases()) if include_aliases else [])


def resolve_preset(name: str) -> str:
    """The canonical name of a preset or alias, or a timm ViT architecture's name (its encoder at the
    architecture's own size, with the paper's decoder); ConfigError (a ValueError) naming the choices otherwise."""
    if name in _PRESETS:
        return _PRESETS.resolve(name)
    if not _is_timm_vit(name):
        raise _PRESETS.unknown(name, also="or a timm ViT architecture (timm.list_models('vit_*'))")
    return name


@functools.lru_cache(maxsize=32)
def _meta_vit(name: str) -> torch.nn.Module:
    """timm's `name` at its defaults, built on the meta device (no memory, no init): for its facts (read
    only; cached, since validation asks several times)."""
    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, num_classes=0)


def _is_timm_vit(name: str) -> bool:
    return timm.is_model(name) and isinstance(_meta_vit(name), VisionTransformer)


def preset_config(name: str) -> dict[str, Any]:
    """The `MaskedAutoencoder` arguments of a preset (a copy); for a timm ViT architecture, its facts
    (patch size, width, depth, heads) and the paper's decoder."""
    name = resolve_preset(name)
    if name in _PRESETS:
        return dict(_PRESETS.get(name))
    vit = _meta_vit(name)
    return {
        "encoder_arch": name,
        "patch_size": vit.patch_embed.patch_size[0],
        "embed_dim": vit.embed_dim,
        "depth": len(vit.blocks),
        "num_heads": vit.blocks[0].attn.num_heads,
        **_PAPER_DECODER,
    }


def preset_matching(**facts: Any) -> dict[str, Any] | None:
    """The arguments of the first preset that agrees with every fact given (e.g. `embed_dim=1024`), or
    None: how a checkpoint's tensors name the architecture they came from."""
    for name in list_presets():
        if all(_PRESETS.get(name).get(k) == v for k, v in facts.items()):
            return dict(_PRESETS.get(name))
    return None


_MODEL_ARGS = frozenset(inspect.signature(MaskedAutoencoder.__init__).parameters) - {"self"}


def create_mae(name: str, **overrides: Any) -> MaskedAutoencoder:
    """Build a preset, with any `MaskedAutoencoder` argument overridden (e.g. `img_size=32`)."""
    unknown = sorted(set(overrides) - _MODEL_ARGS)
    if unknown:
        raise TypeError(f"create_mae: unknown override(s) {unknown}; allowed: {sorted(_MODEL_ARGS)}")
    return MaskedAutoencoder(**{**preset_config(name), **overrides})


_PAPER_DECODER = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16)

# Each preset names the timm architecture its encoder is and states its widths, so it is exact.
register_preset(
    "mae_vit_micro_patch8", encoder_arch="vit_tiny_patch16_224",
    img_size=32, patch_size=8, embed_dim=96, depth=3, num_heads=3,
    decoder_embed_dim=64, decoder_depth=1, decoder_num_heads=2,
)  # fmt: skip
register_preset(
    "mae_vit_tiny_patch16",
    encoder_arch="vit_tiny_patch16_224", aliases=("mae_vit_tiny_patch16_dec256d4b",),
    patch_size=16, embed_dim=192, depth=12, num_heads=3,
    decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8,
)  # fmt: skip
register_preset(
    "mae_vit_small_patch16",
    encoder_arch="vit_small_patch16_224", aliases=("mae_vit_small_patch16_dec256d4b",),
    patch_size=16, embed_dim=384, depth=12, num_heads=6,
    decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8,
)  # fmt: skip
register_preset(
    "mae_vit_base_patch16",
    encoder_arch="vit_base_patch16_224", aliases=("mae_vit_base_patch16_dec512d8b",),
    patch_size=16, embed_dim=768, depth=12, num_heads=12, **_PAPER_DECODER,
)  # fmt: skip
register_preset(
    "mae_vit_large_patch16",
    encoder_arch="vit_large_patch16_224", aliases=("mae_vit_large_patch16_dec512d8b",),
    patch_size=16, embed_dim=1024, depth=24, num_heads=16, **_PAPER_DECODER,
)  # fmt: skip
register_preset(
    "mae_vit_huge_patch14",
    encoder_arch="vit_huge_patch14_224", aliases=("mae_vit_huge_patch14_dec512d8b",),
    img_size=224, patch_size=14, embed_dim=1280, depth=32, num_heads=16, **_PAPER_DECODER,
)  # fmt: skip
