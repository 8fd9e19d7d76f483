"""Decoders: encoder tokens in, pixel predictions out, interchangeable behind one call.

`decoder(latent [N, P + K, D], ids_restore [N, L]) -> (pred [N, L, p*p*C], predicted [N, L])`, where
`predicted` (1 = predicted) tells the loss which patches have a prediction. `mae` is the paper's
decoder (self-attention over all patches); `cross` is CrossMAE's (cross-attention, a chosen fraction of
the masked patches). A new decoder is one class under `@register_decoder(name)`, from this package or
from outside it.

The MAE builds a decoder as `cls(grid_size=, patch_size=, in_chans=, embed_dim=, num_prefix_tokens=,
decoder_embed_dim=, decoder_depth=, decoder_num_heads=, mlp_ratio=, predict_ratio=)` (a decoder may take
`**kwargs` for those it ignores). A classmethod `check_options(**options)` may reject options before any
model is built (`check_decoder`), with a one-line ValueError.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import nn

from mae.models.encoder import set_sincos_pos_embed
from mae.models.masking import gather_tokens
from mae.registry import Registry

_DECODERS: Registry[type[nn.Module]] = Registry("decoder")
D = TypeVar("D", bound=type[nn.Module])


def register_decoder(name: str) -> Callable[[D], D]:
    """Class decorator: `--model.decoder NAME` / `create_mae(..., decoder=NAME)` builds this class."""

    def add(cls: D) -> D:
        return _DECODERS.register(name, cls)

    return add


def unregister_decoder(name: str) -> None:
    """Forget the decoder registered as `name` (a plug-in's tests register their own and remove them after)."""
    _DECODERS.unregister(name)


def list_decoders() -> list[str]:
    """The registered decoder names."""
    return sorted(_DECODERS.names())


def decoder_class(name: str) -> type[nn.Module]:
    """The decoder registered as `name`; ConfigError (a ValueError) naming the choices otherwise."""
    return _DECODERS.get(name)


def check_decoder(name: str, **options: Any) -> None:
    """ValueError (one line) when `name` is unknown or rejects `options` (e.g. `predict_ratio`)."""
    check = getattr(decoder_class(name), "check_options", None)
    if check is not None:
        check(**options)


class PixelDecoder(nn.Module):
    """What every decoder has, and the signature they share: a linear embedding of the encoder tokens to
    the decoder width, one shared mask token, the fixed sine-cosine position table (the official
    [1, 1 + L, D] layout, whose zero first row was the cls token's, so weights load as they are), the
    subclass's `make_blocks`, a norm, and a linear head to `patch_size**2 * in_chans` values per patch."""

    def __init__(
        self,
        *,
        grid_size: tuple[int, int],
        patch_size: int,
        in_chans: int = 3,
        embed_dim: int = 768,
        num_prefix_tokens: int = 1,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
        predict_ratio: float = 1.0,
    ) -> None:
        super().__init__()
        self.check_options(predict_ratio=predict_ratio)
        self.num_prefix_tokens = num_prefix_tokens
        self.predict_ratio = predict_ratio
        self.num_heads = decoder_num_heads
        self.embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.pos_embed = nn.Parameter(
            torch.zeros(1, grid_size[0] * grid_size[1] + 1, decoder_embed_dim), requires_grad=False
        )
        set_sincos_pos_embed(self.pos_embed, grid_size)
        self.blocks = self.make_blocks(decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio)
        self.norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans)

    @classmethod
    def check_options(cls, predict_ratio: float = 1.0, **_: Any) -> None:
        """ValueError when the options do not fit this decoder."""
        if not 0 < predict_ratio <= 1:
            raise ValueError(f"predict_ratio must be in (0, 1], got {predict_ratio}")

    def make_blocks(self, dim: int, depth: int, num_heads: int, mlp_ratio: float) -> nn.Module:
        raise NotImplementedError


@register_decoder("mae")
class MAEDecoder(PixelDecoder):
    """The paper's decoder: encoder tokens plus a mask token for every removed patch, unshuffled to the
    patch order, with positions, through timm blocks (self-attention over every patch)."""

    @classmethod
    def check_options(cls, predict_ratio: float = 1.0, **options: Any) -> None:
        super().check_options(predict_ratio, **options)
        if predict_ratio != 1:
            raise ValueError(
                f"predict_ratio {predict_ratio}: the mae decoder predicts every masked patch; "
                "use --model.decoder cross to predict a fraction of them"
            )

    def make_blocks(self, dim: int, depth: int, num_heads: int, mlp_ratio: float) -> nn.Module:
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        return nn.Sequential(
            *[
                Block(dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=True, norm_layer=norm_layer, mlp_layer=Mlp)
                for _ in range(depth)
            ]
        )

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`latent` [N, P + K, D] (the encoder's P prefix tokens first), `ids_restore` [N, L] -> (`pred`
        [N, L, p*p*C] for every patch, `predicted` [N, L]: all ones)."""
        p = self.num_prefix_tokens
        x = self.embed(latent)
        n, length = ids_restore.shape
        mask_tokens = self.mask_token.to(x.dtype).expand(n, length - (x.shape[1] - p), -1)
        patches = gather_tokens(torch.cat([x[:, p:], mask_tokens], dim=1), ids_restore) + self.pos_embed[:, 1:]
        # Prefix tokens take the table's first row (the official cls position; zero in the sine-cosine table).
        x = torch.cat([x[:, :p] + self.pos_embed[:, :1], patches], dim=1)
        x = self.norm(self.blocks(x))
        pred = self.pred(x[:, p:])
        return pred, torch.ones(n, length, device=pred.device)


class CrossAttention(nn.Module):
    """Queries attend to a separate token sequence (keys and values); no attention among the queries."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"decoder width {dim} is not a multiple of its head count {num_heads}")
        self.num_heads = num_heads
        self.fused_attn = True  # as timm's Attention: False computes it with explicit matmuls
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """`x` [N, M, D] queries, `context` [N, T, D] -> [N, M, D]."""
        n, m, d = x.shape
        h = self.num_heads
        q = self.q(x).reshape(n, m, h, d // h).transpose(1, 2)
        k, v = self.kv(context).reshape(n, -1, 2, h, d // h).permute(2, 0, 3, 1, 4)
        if self.fused_attn:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = ((q * (d // h) ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, m, d))


class CrossBlock(nn.Module):
    """Pre-norm cross-attention then MLP, each residual (CrossMAE's decoder block)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm_context = nn.LayerNorm(dim, eps=1e-6)
        self.attn = CrossAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), self.norm_context(context))
        return x + self.mlp(self.norm2(x))


@register_decoder("cross")
class CrossDecoder(PixelDecoder):
    """CrossMAE's decoder (Fu et al., 2024): mask tokens for a fraction of the masked patches attend to the
    encoder's tokens, never to each other, and only they are predicted.

    Which masked patches are predicted follows the masking's own random order (`ids_restore`), so it
    needs no randomness of its own: the first `round(predict_ratio x (L - K))` masked patches.
    """

    def make_blocks(self, dim: int, depth: int, num_heads: int, mlp_ratio: float) -> nn.Module:
        return nn.ModuleList(CrossBlock(dim, num_heads, mlp_ratio) for _ in range(depth))

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`latent` [N, P + K, D], `ids_restore` [N, L] -> (`pred` [N, L, p*p*C], zero where not predicted;
        `predicted` [N, L], 1 = predicted)."""
        p = self.num_prefix_tokens
        n, length = ids_restore.shape
        keep = latent.shape[1] - p
        count = max(1, round(self.predict_ratio * (length - keep)))
        ids_shuffle = torch.argsort(ids_restore, dim=1)  # kept first, then masked in the masking's order
        ids_visible, ids_pred = ids_shuffle[:, :keep], ids_shuffle[:, keep : keep + count]
        pos = self.pos_embed[:, 1:].expand(n, -1, -1)
        context = self.embed(latent)
        context = torch.cat([context[:, :p], context[:, p:] + gather_tokens(pos, ids_visible)], dim=1)
        x = self.mask_token.to(context.dtype) + gather_tokens(pos, ids_pred)
        for block in self.blocks:
            x = block(x, context)
        out = self.pred(self.norm(x))
        pred = out.new_zeros(n, length, out.shape[-1]).scatter(1, ids_pred.unsqueeze(-1).expand_as(out), out)
        predicted = torch.zeros(n, length, device=out.device).scatter(1, ids_pred, 1.0)
        return pred, predicted
