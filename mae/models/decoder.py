"""The MAE decoder: a light Transformer over encoder tokens plus mask tokens, predicting pixels."""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import nn

from mae.models.encoder import set_sincos_pos_embed
from mae.models.masking import gather_tokens


class MAEDecoder(nn.Module):
    """Encoder tokens (cls + visible) -> pixel predictions for every patch.

    Linear embedding to the decoder width, one shared mask token for every removed patch,
    unshuffle to the original patch order, a fixed sine-cosine position embedding, timm blocks,
    a norm and a linear head to `patch_size**2 * in_chans` values per patch.
    """

    def __init__(
        self,
        *,
        grid_size: tuple[int, int],
        patch_size: int,
        in_chans: int = 3,
        embed_dim: int = 768,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        num_patches = grid_size[0] * grid_size[1]
        self.embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=False)
        set_sincos_pos_embed(self.pos_embed, grid_size)
        self.blocks = nn.Sequential(
            *[
                Block(
                    decoder_embed_dim,
                    decoder_num_heads,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=True,
                    norm_layer=norm_layer,
                    mlp_layer=Mlp,
                )
                for _ in range(decoder_depth)
            ]
        )
        self.norm = norm_layer(decoder_embed_dim)
        self.pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans)

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """`latent` [N, 1 + K, D] (cls first), `ids_restore` [N, L] -> `pred` [N, L, p*p*C]."""
        x = self.embed(latent)
        n, length = ids_restore.shape
        mask_tokens = self.mask_token.to(x.dtype).expand(n, length - (x.shape[1] - 1), -1)
        patches = gather_tokens(torch.cat([x[:, 1:], mask_tokens], dim=1), ids_restore)
        x = torch.cat([x[:, :1], patches], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.pred(x[:, 1:])
