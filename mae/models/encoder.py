"""The MAE encoder: a plain timm `VisionTransformer` with a fixed sine-cosine position embedding.

Using timm's class itself (not a copy) keeps the weights timm-native: the encoder exports with
timm's key names and `forward_features` is timm's own code path.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mae.models.pos_embed import sincos_2d


def create_encoder(
    *,
    img_size: int | tuple[int, int] = 224,
    patch_size: int = 16,
    in_chans: int = 3,
    embed_dim: int = 768,
    depth: int = 12,
    num_heads: int = 12,
    mlp_ratio: float = 4.0,
    global_pool: str = "token",
    drop_path_rate: float = 0.0,
) -> VisionTransformer:
    """A timm ViT (no head) with the MAE's frozen 2-D sine-cosine position embedding."""
    encoder = VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        num_classes=0,
        global_pool=global_pool,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_ratio,
        qkv_bias=True,
        drop_path_rate=drop_path_rate,
        weight_init="skip",  # the MAE initialisation below replaces timm's
    )
    set_sincos_pos_embed(encoder.pos_embed, tuple(encoder.patch_embed.grid_size))
    return encoder


def set_sincos_pos_embed(pos_embed: nn.Parameter, grid_size: tuple[int, int]) -> None:
    """Fill a [1, 1 + gh*gw, D] position embedding with the sine-cosine table and freeze it."""
    table = sincos_2d(pos_embed.shape[-1], grid_size, cls_token=True)
    with torch.no_grad():
        pos_embed.copy_(table.unsqueeze(0))
    pos_embed.requires_grad_(False)


def init_mae_weights(model: nn.Module) -> None:
    """The official MAE initialisation of every module below `model`.

    Linear layers xavier-uniform with zero bias, LayerNorms (1, 0), the patch projection
    xavier-uniform as if it were a linear layer, cls and mask tokens normal(std=0.02).
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
        if name.endswith(("cls_token", "mask_token")):
            nn.init.normal_(param, std=0.02)
