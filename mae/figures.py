"""Pictures of a model: reconstruction grids (original | masked | reconstruction | reconstruction +
visible patches) and the cls token's attention maps."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torchvision.utils import make_grid, save_image

from mae.data.transforms import denormalize, normalize
from mae.models import MaskedAutoencoder, encoder_adapter


@torch.no_grad()
def reconstruction_grid(
    model: MaskedAutoencoder,
    images: torch.Tensor,
    noise: torch.Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    bands: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, float]:
    """`images` [N, C, H, W] (uint8, or float in [0, 1]), `noise` [N, L] -> (an RGB grid [3, H', W'] in
    [0, 1] with a row per image, the loss on these images). One channel shows as grey; more than three
    through `bands` (red, green, blue; default the first three).

    Norm-pix predictions are mapped back to pixels with each patch's true mean and std, as the
    paper's figures do; masked areas are shown grey.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x = normalize(images.to(device), mean, std)
    out = model(x, noise=noise.to(device))
    pred = model.target_to_pixels(out.pred.float(), x)
    mask = out.mask.unsqueeze(-1).expand_as(pred)  # 1 = masked
    recon = model.unpatchify(pred)
    mask_img = model.unpatchify(mask)
    grey = torch.full_like(x, 0.5)
    original = denormalize(x, mean, std)
    masked = torch.where(mask_img.bool(), grey, original)
    reconstructed = denormalize(recon, mean, std)
    pasted = torch.where(mask_img.bool(), reconstructed, original)
    rows = torch.stack([as_rgb(t, bands) for t in (original, masked, reconstructed, pasted)], dim=1).flatten(0, 1)
    model.train(was_training)
    return make_grid(enlarge(rows.float().cpu()), nrow=4, padding=2, pad_value=1.0), out.loss.item()


# Small images (28-px digits) are drawn this large at least, so that a grid reads without zooming.
MIN_SHOWN_SIDE = 128


def enlarge(images: torch.Tensor, min_side: int = MIN_SHOWN_SIDE) -> torch.Tensor:
    """[N, C, H, W] -> the same images scaled up by the smallest whole factor that makes the shorter side at
    least `min_side` (nearest neighbour: each pixel becomes a sharp square); larger images as they are."""
    factor = -(-min_side // min(images.shape[-2:]))
    return images if factor <= 1 else F.interpolate(images, scale_factor=factor, mode="nearest")


def as_rgb(images: torch.Tensor, bands: tuple[int, int, int] | None = None) -> torch.Tensor:
    """[N, C, H, W] -> [N, 3, H, W] for display: grey for one channel, `bands` (or the first three) else."""
    if images.shape[1] == 1:
        return images.expand(-1, 3, -1, -1)
    return images[:, list(bands or (0, 1, 2))]


def save_grid(grid: torch.Tensor, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(grid, path)
    return path


@torch.no_grad()
def cls_attention(vit: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """The cls token's attention over the patches in the last block: [N, heads, gh, gw] (normalised
    images in; each head's row over all tokens sums to 1, the prefix tokens' share is left out).

    Read with timm's `AttentionExtract` from the last block's attention weights (its explicit path,
    where the softmax passes through `attn_drop`)."""
    adapter = encoder_adapter(vit)
    if not adapter.has_class_token:
        raise ValueError("this encoder has no class token, so it has no cls attention to show")
    from timm.utils import AttentionExtract

    last = adapter.depth - 1
    attn = vit.blocks[last].attn  # ViT-specific: the attention module's name and its `fused_attn` switch are timm's
    fused, attn.fused_attn = attn.fused_attn, False
    try:
        weights = next(
            iter(AttentionExtract(vit, names=[f"blocks.{last}.attn.attn_drop"], method="hook")(images).values())
        )
    finally:
        attn.fused_attn = fused
    gh, gw = adapter.grid_size
    return weights[:, :, 0, adapter.num_prefix_tokens :].reshape(len(images), -1, gh, gw)


def attention_grid(
    vit: VisionTransformer, images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], max_heads: int = 6
) -> torch.Tensor:
    """`images` uint8 [N, 3, H, W] -> a grid with a row per image: the image, the head-averaged cls
    attention overlaid on it, then up to `max_heads` single heads."""
    vit.eval()
    x = normalize(images, mean, std)
    maps = cls_attention(vit, x)
    maps = torch.cat([maps.mean(1, keepdim=True), maps[:, :max_heads]], dim=1)  # [N, 1 + h, gh, gw]
    maps = F.interpolate(maps, size=x.shape[-2:], mode="bilinear", align_corners=False)
    lo, hi = maps.amin((2, 3), keepdim=True), maps.amax((2, 3), keepdim=True)
    heat = ((maps - lo) / (hi - lo).clamp_min(1e-12)).unsqueeze(2)  # [N, 1 + h, 1, H, W]
    original = as_rgb(denormalize(x, mean, std))
    overlay = heat_overlay(original.unsqueeze(1), heat)
    rows = torch.cat([original.unsqueeze(1), overlay], dim=1).flatten(0, 1)
    return make_grid(enlarge(rows.float().cpu()), nrow=maps.shape[1] + 1, padding=2, pad_value=1.0)


def heat_colour(heat: torch.Tensor) -> torch.Tensor:
    """[..., 1, H, W] in [0, 1] -> [..., 3, H, W]: dark blue -> red -> yellow."""
    return torch.cat([heat, heat**2, 0.2 * (1 - heat)], dim=-3)


def heat_overlay(original: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """RGB images [..., 3, H, W] in [0, 1] with `heat` [..., 1, H, W] in [0, 1] laid over them."""
    return 0.45 * original + 0.55 * heat_colour(heat)


def roc_figure(fpr, tpr, path: str | Path, label: str, side: int = 320) -> Path:
    """A ROC curve (false positive rate across, true positive rate up) with the chance diagonal and `label`,
    as a PNG (drawn with PIL: matplotlib is not a dependency)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(img)
    m = 30  # margin for the axes' words
    scale = side - 2 * m

    def xy(x: float, y: float) -> tuple[float, float]:
        return m + x * scale, side - m - y * scale

    draw.rectangle([xy(0, 1), xy(1, 0)], outline="black")
    draw.line([xy(0, 0), xy(1, 1)], fill=(170, 170, 170))
    draw.line([xy(float(x), float(y)) for x, y in zip(fpr, tpr, strict=True)], fill=(200, 30, 30), width=2)
    draw.text((m, 8), label, fill="black")
    draw.text((side // 2 - 50, side - m + 8), "false positive rate", fill="black")
    draw.text((4, m - 14), "TPR", fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path
