"""`MaskedAutoencoder`: encoder on the visible patches, decoder on all, MSE on the masked ones."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import NamedTuple

import torch
from torch import nn

from mae.models.decoder import decoder_class
from mae.models.encoder import EncoderAdapter, create_encoder, encoder_adapter, init_mae_weights
from mae.models.masking import Masking, gather_tokens, random_masking
from mae.models.patches import patchify, unpatchify
from mae.models.spec import ModelSpec


class MAEOutput(NamedTuple):
    """loss: scalar; pred: [N, L, p*p*C]; mask: [N, L] (1 = masked, 0 = visible); ids_restore: [N, L]."""

    loss: torch.Tensor
    pred: torch.Tensor
    mask: torch.Tensor
    ids_restore: torch.Tensor


_RECORDED = frozenset(f.name for f in fields(ModelSpec))


def _create_encoder(
    arch: str,
    img_size: tuple[int, int],
    patch_size: int | None,
    in_chans: int,
    embed_dim: int | None,
    depth: int | None,
    num_heads: int | None,
    mlp_ratio: float | None,
    decoder_embed_dim: int,
) -> nn.Module:
    """The MAE's timm encoder, its sizes checked (the widths must suit the 2-D sine-cosine tables)."""
    sizes = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads, "mlp_ratio": mlp_ratio}
    for name, w in (("embed_dim", embed_dim or 4), ("decoder_embed_dim", decoder_embed_dim)):
        if w % 4:
            raise ValueError(f"{name} must be divisible by 4 for the 2-D sine-cosine table, got {w}")
    overrides = {k: v for k, v in sizes.items() if v is not None}
    return create_encoder(arch, img_size=img_size, patch_size=patch_size, in_chans=in_chans, **overrides)


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class MaskedAutoencoder(nn.Module):
    """Masked autoencoder with a timm `VisionTransformer` encoder (He et al., 2021).

    `img_size` may be an int or `(H, W)`; both must be multiples of `patch_size`.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | None = None,
        in_chans: int = 3,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float | None = None,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        decoder_mlp_ratio: float = 4.0,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = True,
        encoder_arch: str = "vit_base_patch16_224",
        decoder: str = "mae",
        predict_ratio: float = 1.0,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
    ) -> None:
        """`encoder_arch` is a timm architecture; `patch_size`, `embed_dim`, `depth`, `num_heads` and `mlp_ratio` change
        its values (None keeps them). `decoder` names a registered decoder (`list_decoders()`: the paper's "mae",
        CrossMAE's "cross", which predicts `predict_ratio` of the masked patches, or yours). `mean` / `std`: the
        normalisation of its inputs, recorded in `spec` (the forward pass takes normalised images)."""
        given = {k: v for k, v in locals().items() if k in _RECORDED}  # every argument is in the record
        decoder_cls = decoder_class(decoder)
        super().__init__()
        img_size = _pair(img_size)
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
        self.encoder = _create_encoder(encoder_arch, img_size, patch_size, in_chans, embed_dim, depth, num_heads,
                                       mlp_ratio, decoder_embed_dim)  # fmt: skip
        adapter = self.adapter
        _, args = adapter.timm_architecture()  # the architecture's own values, where an argument left them
        resolved = {"img_size": img_size, "patch_size": adapter.patch_size[0], "embed_dim": adapter.embed_dim,
                    "depth": adapter.depth, "num_heads": adapter.num_heads,
                    "mlp_ratio": args.get("mlp_ratio", mlp_ratio)}  # fmt: skip
        self._spec = ModelSpec(**{**given, **resolved})  # the one copy of these facts: the properties below read it
        if img_size[0] % self.patch_size or img_size[1] % self.patch_size:
            raise ValueError(
                f"img_size {img_size[0]}x{img_size[1]} is not divisible by patch_size {self.patch_size}; "
                "choose an image size that is a multiple of the patch size"
            )
        self.decoder = decoder_cls(
            grid_size=self.grid_size, patch_size=self.patch_size, in_chans=in_chans, embed_dim=adapter.embed_dim,
            num_prefix_tokens=adapter.num_prefix_tokens, decoder_embed_dim=decoder_embed_dim,
            decoder_depth=decoder_depth, decoder_num_heads=decoder_num_heads, mlp_ratio=decoder_mlp_ratio,
            predict_ratio=predict_ratio,
        )  # fmt: skip
        init_mae_weights(self)

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> MaskedAutoencoder:
        """A freshly initialised model of `spec` (`model.spec == spec`)."""
        return cls(**spec.model_args())

    @property
    def spec(self) -> ModelSpec:
        """The record of this model: what rebuilds it (`from_spec`) and the inputs it expects."""
        return self._spec

    def record_stats(self, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> None:
        """Record the normalisation of the data it trains on (None keeps what is recorded)."""
        self._spec = self._spec.with_stats(mean, std)

    # The model's facts, read from its record (one copy): the input, the encoder architecture, the decoder's name.
    img_size = property(lambda self: self._spec.img_size, doc="Input (height, width).")
    patch_size = property(lambda self: self._spec.patch_size, doc="A patch's side in pixels.")
    grid_size = property(lambda self: self._spec.grid_size, doc="Patches per (column, row).")
    in_chans = property(lambda self: self._spec.in_chans, doc="Input channels.")
    encoder_arch = property(lambda self: self._spec.encoder_arch, doc="The timm architecture of the encoder.")
    decoder_name = property(lambda self: self._spec.decoder, doc="The registered decoder's name.")

    # The pretext task's settings change no weight: they may be set on a built model, and the record follows.
    @property
    def mask_ratio(self) -> float:
        return self._spec.mask_ratio

    @mask_ratio.setter
    def mask_ratio(self, value: float) -> None:
        self._spec = replace(self._spec, mask_ratio=value)

    @property
    def norm_pix_loss(self) -> bool:
        return self._spec.norm_pix_loss

    @norm_pix_loss.setter
    def norm_pix_loss(self, value: bool) -> None:
        self._spec = replace(self._spec, norm_pix_loss=value)

    @property
    def adapter(self) -> EncoderAdapter:
        """How this MAE drives its encoder (made on demand: it holds no state of its own)."""
        return encoder_adapter(self.encoder)

    @property
    def num_patches(self) -> int:
        return self.grid_size[0] * self.grid_size[1]

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, L, p*p*C]."""
        return patchify(imgs, self.patch_size)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """[N, L, p*p*C] -> [N, C, H, W]."""
        return unpatchify(x, self.patch_size, self.grid_size, self.in_chans)

    def forward_encoder(
        self, imgs: torch.Tensor, mask_ratio: float, noise: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Masking]:
        """Embed all patches, keep the visible ones, run the encoder on its prefix tokens + the visible.

        Returns the latent [N, P + K, D] (the P prefix tokens first, e.g. the cls token; then the
        visible tokens in `ids_keep` order) and the `Masking`. Positions are added before masking, so
        each token keeps its place.
        """
        enc = self.adapter
        prefix, patches = enc.embed(imgs)
        n, length, _ = patches.shape
        if noise is None:
            noise = torch.rand(n, length, device=patches.device)
        masking = random_masking(noise, mask_ratio)
        x = torch.cat([prefix.to(patches.dtype), gather_tokens(patches, masking.ids_keep)], dim=1)
        return enc.norm(enc.blocks(x)), masking

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """[N, P + K, D] -> pixel predictions [N, L, p*p*C] (zero where the decoder predicts nothing)."""
        return self.decoder(latent, ids_restore)[0]

    def forward_target(self, imgs: torch.Tensor) -> torch.Tensor:
        """The regression target [N, L, p*p*C]: patches, per-patch normalised if `norm_pix_loss`."""
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)  # unbiased, as the reference
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        return target

    def target_to_pixels(self, pred: torch.Tensor, imgs: torch.Tensor) -> torch.Tensor:
        """The inverse of `forward_target`: predictions [N, L, p*p*C] in the target space -> patches of `imgs`' own
        (normalised) pixel space, each patch rescaled with the true patch's mean and std when `norm_pix_loss` (as the
        paper's figures show reconstructions)."""
        if not self.norm_pix_loss:
            return pred
        target = self.patchify(imgs.float())
        return pred * (target.var(dim=-1, keepdim=True) + 1.0e-6) ** 0.5 + target.mean(dim=-1, keepdim=True)

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over masked patches of the per-patch MSE; `mask` [N, L] has 1 = masked."""
        target = self.forward_target(imgs.float())
        loss = (pred.float() - target).pow(2).mean(dim=-1)
        return (loss * mask).sum() / mask.sum()

    def forward(
        self, imgs: torch.Tensor, mask_ratio: float | None = None, noise: torch.Tensor | None = None
    ) -> MAEOutput:
        """`imgs` [N, C, H, W]; `noise` [N, L] ranks patches (ascending = kept first)."""
        mask_ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        latent, masking = self.forward_encoder(imgs, mask_ratio, noise)
        pred, predicted = self.decoder(latent, masking.ids_restore)
        loss = self.forward_loss(imgs, pred, masking.mask * predicted)  # masked patches with a prediction
        return MAEOutput(loss, pred, masking.mask, masking.ids_restore)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters kept out of weight decay besides biases and norms (timm's convention)."""
        return {f"encoder.{k}" for k in self.encoder.no_weight_decay()} | {"decoder.pos_embed", "decoder.mask_token"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute encoder block activations in backward, trading compute for memory."""
        self.encoder.set_grad_checkpointing(enable)
