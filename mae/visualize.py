"""Reconstruction previews: original | masked | reconstruction | reconstruction + visible patches."""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.utils import make_grid, save_image

from mae.data.transforms import denormalize, normalize
from mae.models import MaskedAutoencoder


@torch.no_grad()
def reconstruction_grid(
    model: MaskedAutoencoder,
    images: torch.Tensor,
    noise: torch.Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> tuple[torch.Tensor, float]:
    """`images` uint8 [N, 3, H, W], `noise` [N, L] -> (an RGB grid [3, H', W'] in [0, 1] with a row per
    image, the loss on these images).

    Norm-pix predictions are mapped back to pixels with each patch's true mean and std, as the
    paper's figures do; masked areas are shown grey.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x = normalize(images.to(device), mean, std)
    out = model(x, noise=noise.to(device))
    pred = out.pred.float()
    if model.norm_pix_loss:
        target = model.patchify(x)
        pred = pred * (target.var(-1, keepdim=True) + 1.0e-6) ** 0.5 + target.mean(-1, keepdim=True)
    mask = out.mask.unsqueeze(-1).expand_as(pred)  # 1 = masked
    recon = model.unpatchify(pred)
    mask_img = model.unpatchify(mask)
    grey = torch.full_like(x, 0.5)
    original = denormalize(x, mean, std)
    masked = torch.where(mask_img.bool(), grey, original)
    reconstructed = denormalize(recon, mean, std)
    pasted = torch.where(mask_img.bool(), reconstructed, original)
    rows = torch.stack([original, masked, reconstructed, pasted], dim=1).flatten(0, 1)
    model.train(was_training)
    return make_grid(rows.float().cpu(), nrow=4, padding=2, pad_value=1.0), out.loss.item()


def save_grid(grid: torch.Tensor, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, path)
    return path
