"""The MAE's encoder: a timm model driven through a small interface, with fixed sine-cosine positions.

The MAE never touches a backbone's attributes. It asks an `EncoderAdapter` to embed the patches
(with their positions, plus the backbone's prefix tokens), runs the adapter's blocks on the prefix
tokens and the kept patches, and takes its norm. `TimmViT` implements that once for timm's
`VisionTransformer`, whatever its prefix tokens (a class token, register tokens, both, or none).
The adapter also reports the backbone's facts (patch and grid size, prefix tokens, width, depth, heads, the timm
architecture that rebuilds it), so export, import, the classifiers and the pictures ask it, never the module.
`encoder_adapter(module)` works on an MAE's encoder or a bare timm ViT classifier.

The family is timm's ViT, on purpose and only: the downstream stages build timm ViT classifiers, the exports are
timm ViT checkpoints, layer decay and partial fine-tuning follow timm's ViT. The interface keeps the MAE readable
(embed, keep, blocks, norm), not a plug-in point: another backbone family would need all of those too.

`EncoderSpec` is an encoder as the downstream stages receive it: weights, architecture, statistics.

The encoder module itself stays the timm model (not a copy or a wrapper), so it exports with timm's
key names and `forward_features` is timm's own code path.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import timm
import torch
from timm.layers import Mlp
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mae.models.pos_embed import sincos_2d
from mae.models.spec import ModelSpec


class EncoderAdapter(ABC):
    """How the MAE drives a backbone module (held, not owned: the module stays the backbone's own)."""

    module_type: type[nn.Module]  # the backbone class this adapter drives

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    @abstractmethod
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches in the sequence (class, register tokens); their output is not a patch."""

    @property
    @abstractmethod
    def has_class_token(self) -> bool:
        """Whether the first prefix token is a class token (what "token" pooling and cls attention read)."""

    @property
    @abstractmethod
    def embed_dim(self) -> int:
        """The token width D."""

    @property
    @abstractmethod
    def depth(self) -> int:
        """The number of transformer blocks."""

    @property
    @abstractmethod
    def num_heads(self) -> int:
        """Attention heads per block."""

    @property
    @abstractmethod
    def patch_size(self) -> tuple[int, int]:
        """A patch's (height, width) in pixels."""

    @property
    @abstractmethod
    def grid_size(self) -> tuple[int, int]:
        """Patches per (column, row) at the module's input size: L = gh * gw."""

    @property
    @abstractmethod
    def in_chans(self) -> int:
        """Input channels."""

    @abstractmethod
    def timm_architecture(self) -> tuple[str, dict[str, Any]]:
        """(a timm architecture name, the model args that make it exactly this backbone, without head):
        `timm.create_model(name, num_classes=0, **args)` rebuilds it, key for key."""

    family: str = "encoder"  # the backbone family in words, for `describe`

    @property
    def img_size(self) -> tuple[int, int]:
        """The input (height, width) the module was built for."""
        (gh, gw), (ph, pw) = self.grid_size, self.patch_size
        return gh * ph, gw * pw

    def describe(self) -> str:
        """The backbone in words, e.g. "ViT 192 wide, 12 blocks, patch 8, 64x64" (an architecture's name
        fixes a patch size and input that the model args may change)."""
        (h, w), (ph, pw) = self.img_size, self.patch_size
        patch = ph if ph == pw else f"{ph}x{pw}"
        return f"{self.family} {self.embed_dim} wide, {self.depth} blocks, patch {patch}, {h}x{w}"

    @abstractmethod
    def embed(self, imgs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`imgs` [N, C, H, W] -> (prefix tokens [N, P, D], patch tokens [N, L, D]), each with its position."""

    @abstractmethod
    def blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the transformer on [N, P + K, D] tokens (any K: the visible patches only)."""

    @abstractmethod
    def norm(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final norm of the token sequence."""

    @abstractmethod
    def set_position_table(self, grid_size: tuple[int, int]) -> None:
        """Make the patch positions the fixed 2-D sine-cosine table (the MAE's), frozen."""


class TimmViT(EncoderAdapter):
    """timm's `VisionTransformer`: class token or not, register tokens or not, position rows for the
    prefix tokens or not (`no_embed_class`), exactly as timm's own forward adds them."""

    module_type = VisionTransformer
    family = "ViT"

    @property
    def num_prefix_tokens(self) -> int:
        return self.module.num_prefix_tokens

    @property
    def has_class_token(self) -> bool:
        return self.module.cls_token is not None

    @property
    def embed_dim(self) -> int:
        return self.module.embed_dim

    @property
    def depth(self) -> int:
        return len(self.module.blocks)

    @property
    def num_heads(self) -> int:
        return self.module.blocks[0].attn.num_heads

    @property
    def patch_size(self) -> tuple[int, int]:
        p = self.module.patch_embed.patch_size
        return (p, p) if isinstance(p, int) else (int(p[0]), int(p[1]))

    @property
    def grid_size(self) -> tuple[int, int]:
        gh, gw = self.module.patch_embed.grid_size
        return int(gh), int(gw)

    @property
    def in_chans(self) -> int:
        return self.module.patch_embed.proj.in_channels

    def timm_architecture(self) -> tuple[str, dict[str, Any]]:
        vit = self.module
        ph, pw = self.patch_size
        args: dict[str, Any] = {
            "img_size": list(self.img_size),
            "patch_size": ph if ph == pw else [ph, pw],
            "in_chans": self.in_chans,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
        }
        mlp = vit.blocks[0].mlp
        if type(mlp) is Mlp:  # timm's plain MLP, whose width is embed_dim * mlp_ratio; gated MLPs keep the arch's
            args["mlp_ratio"] = _ratio(mlp.fc1.out_features, self.embed_dim)
        # The prefix tokens too, so a model built with other ones than its architecture's rebuilds as it is.
        args.update(class_token=self.has_class_token, reg_tokens=vit.num_reg_tokens, global_pool=vit.global_pool)
        name = (getattr(vit, "pretrained_cfg", None) or {}).get("architecture")
        if not name:
            raise ValueError("this ViT was not built by timm.create_model, so no timm architecture names it")
        return name, args

    def embed(self, imgs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vit = self.module
        # timm's own positional step (its only form: no public method gives "tokens with position"), so
        # every prefix-token variant is positioned exactly as in `forward_features`.
        x = vit._pos_embed(vit.patch_embed(imgs))
        return x[:, : vit.num_prefix_tokens], x[:, vit.num_prefix_tokens :]

    def blocks(self, tokens: torch.Tensor) -> torch.Tensor:
        vit = self.module
        x = vit.norm_pre(tokens)
        if vit.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint_seq(vit.blocks, x)
        return vit.blocks(x)

    def norm(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module.norm(tokens)

    def set_position_table(self, grid_size: tuple[int, int]) -> None:
        set_sincos_pos_embed(self.module.pos_embed, grid_size)  # no prefix rows with no_embed_class


def encoder_adapter(module: nn.Module) -> EncoderAdapter:
    """The adapter for an encoder module: timm's `VisionTransformer` family is the one this toolkit drives (its
    downstream stages, exports and classifiers are timm ViTs too); TypeError for any other module."""
    if isinstance(module, TimmViT.module_type):
        return TimmViT(module)
    raise TypeError(
        f"no encoder adapter drives a {type(module).__name__}: the encoder is a timm VisionTransformer (any timm ViT "
        "architecture, with any prefix tokens)"
    )


def _ratio(hidden: int, dim: int) -> float:
    """The mlp_ratio for which timm's `int(dim * mlp_ratio)` is `hidden`."""
    ratio = hidden / dim
    while int(dim * ratio) < hidden:  # a quotient rounded down by one ulp would lose a unit
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def create_encoder(
    arch: str = "vit_base_patch16_224",
    *,
    img_size: int | tuple[int, int] = 224,
    patch_size: int | None = None,
    in_chans: int = 3,
    drop_path_rate: float = 0.0,
    **arch_overrides: object,
) -> nn.Module:
    """A timm backbone `arch` (no head), sized by the given options, with the MAE's fixed sine-cosine
    patch positions. `arch_overrides` (embed_dim, depth, num_heads, mlp_ratio, ...) change the
    architecture's own values; those left out keep them."""
    kwargs = {"img_size": img_size, "in_chans": in_chans, **arch_overrides}
    if patch_size is not None:
        kwargs["patch_size"] = patch_size
    encoder = timm.create_model(
        arch, pretrained=False, num_classes=0, drop_path_rate=drop_path_rate, weight_init="skip", **kwargs
    )
    adapter = encoder_adapter(encoder)
    adapter.set_position_table(adapter.grid_size)
    return encoder


@dataclass(frozen=True)
class EncoderSpec:
    """An encoder as the downstream stages receive it: `timm.create_model(arch, **args)` with `state` loaded
    (timm key names) is the encoder, pretrained on images normalised with `mean` and `std` (the record's)."""

    arch: str
    args: dict[str, Any]
    state: dict[str, torch.Tensor]
    mean: tuple[float, ...] | None  # None: never recorded, and no default for this channel count
    std: tuple[float, ...] | None
    record: ModelSpec | None = None  # the model record it came with (written into what is made of it)

    @property
    def in_chans(self) -> int:
        return int(self.args.get("in_chans", 3))

    @property
    def img_size(self) -> tuple[int, int]:
        """(H, W) the encoder was built for."""
        size = self.args["img_size"]
        return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))

    @property
    def has_class_token(self) -> bool:
        args = {k: v for k, v in self.args.items() if k != "global_pool"}  # "token" pooling needs a class token
        with torch.device("meta"):  # no memory, no init: only the structure matters
            module = timm.create_model(self.arch, pretrained=False, num_classes=0, **args)
        return encoder_adapter(module).has_class_token


def set_sincos_pos_embed(pos_embed: nn.Parameter, grid_size: tuple[int, int]) -> None:
    """Fill a [1, P + gh*gw, D] position embedding with the sine-cosine table (P leading zero rows, for
    prefix tokens) and freeze it."""
    prefix_rows = pos_embed.shape[1] - grid_size[0] * grid_size[1]
    table = sincos_2d(pos_embed.shape[-1], grid_size)
    table = torch.cat([torch.zeros(prefix_rows, table.shape[1], dtype=table.dtype), table])
    with torch.no_grad():
        pos_embed.copy_(table.unsqueeze(0))
    pos_embed.requires_grad_(False)


def init_mae_weights(model: nn.Module) -> None:
    """The official MAE initialisation of every module below `model`.

    Linear layers xavier-uniform with zero bias, LayerNorms (1, 0), the patch projection
    xavier-uniform as if it were a linear layer, cls, register and mask tokens normal(std=0.02).
    Position embeddings are fixed tables and stay as they are.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv2d) and name.endswith("patch_embed.proj"):
            w = module.weight.data
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    for name, param in model.named_parameters():
        if name.endswith(("cls_token", "reg_token", "mask_token")):
            nn.init.normal_(param, std=0.02)
