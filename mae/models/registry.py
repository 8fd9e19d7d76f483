"""Named architectures and the one factory, `create_mae`.

Names follow timm and the official code: `mae_vit_{size}_patch{p}` with the decoder spelled out
in the long form (`_dec512d8b` = 512 wide, 8 blocks).
"""

from __future__ import annotations

import inspect
from typing import Any

from mae.models.mae import MaskedAutoencoder

_PRESETS: dict[str, dict[str, Any]] = {}
_ALIASES: dict[str, str] = {}


def register_preset(name: str, *, aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
    """Add a preset: `kwargs` are `MaskedAutoencoder` arguments."""
    _PRESETS[name] = kwargs
    for alias in aliases:
        _ALIASES[alias] = name


def list_presets(include_aliases: bool = False) -> list[str]:
    """The preset names `create_mae` accepts."""
    return sorted(_PRESETS) + (sorted(_ALIASES) if include_aliases else [])


def resolve_preset(name: str) -> str:
    """The canonical name of a preset or alias; ValueError naming the choices otherwise."""
    name = _ALIASES.get(name, name)
    if name not in _PRESETS:
        raise ValueError(f"unknown preset '{name}'; choose one of: {', '.join(list_presets(True))}")
    return name


def preset_config(name: str) -> dict[str, Any]:
    """The `MaskedAutoencoder` arguments of a preset (a copy)."""
    return dict(_PRESETS[resolve_preset(name)])


_MODEL_ARGS = frozenset(inspect.signature(MaskedAutoencoder.__init__).parameters) - {"self"}


def create_mae(name: str, **overrides: Any) -> MaskedAutoencoder:
    """Build a preset, with any `MaskedAutoencoder` argument overridden (e.g. `img_size=32`)."""
    unknown = sorted(set(overrides) - _MODEL_ARGS)
    if unknown:
        raise TypeError(f"create_mae: unknown override(s) {unknown}; allowed: {sorted(_MODEL_ARGS)}")
    return MaskedAutoencoder(**{**preset_config(name), **overrides})


_PAPER_DECODER = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16)

register_preset(
    "mae_vit_micro_patch8",
    img_size=32, patch_size=8, embed_dim=96, depth=3, num_heads=3,
    decoder_embed_dim=64, decoder_depth=1, decoder_num_heads=2,
)  # fmt: skip
register_preset(
    "mae_vit_tiny_patch16",
    aliases=("mae_vit_tiny_patch16_dec256d4b",),
    patch_size=16, embed_dim=192, depth=12, num_heads=3,
    decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8,
)  # fmt: skip
register_preset(
    "mae_vit_small_patch16",
    aliases=("mae_vit_small_patch16_dec256d4b",),
    patch_size=16, embed_dim=384, depth=12, num_heads=6,
    decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8,
)  # fmt: skip
register_preset(
    "mae_vit_base_patch16",
    aliases=("mae_vit_base_patch16_dec512d8b",),
    patch_size=16, embed_dim=768, depth=12, num_heads=12, **_PAPER_DECODER,
)  # fmt: skip
register_preset(
    "mae_vit_large_patch16",
    aliases=("mae_vit_large_patch16_dec512d8b",),
    patch_size=16, embed_dim=1024, depth=24, num_heads=16, **_PAPER_DECODER,
)  # fmt: skip
register_preset(
    "mae_vit_huge_patch14",
    aliases=("mae_vit_huge_patch14_dec512d8b",),
    img_size=224, patch_size=14, embed_dim=1280, depth=32, num_heads=16, **_PAPER_DECODER,
)  # fmt: skip
