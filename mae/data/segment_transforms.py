"""Joint transforms of an image and its mask (`mae segment`): what moves one moves the other. Training: a random
rescale (the image's cover of the model input times a factor drawn from `scale`), a random crop of the input size
(padded with the ignore index where the image is smaller), a horizontal flip. The mmsegmentation pipeline
(Resize with a ratio range, RandomCrop, RandomFlip); masks are resized by nearest neighbour, never blended.
Evaluation: the image at its own size, normalised (the model slides a window over it: `Segmenter.segment`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mae.data.masks import IGNORE


def cover_scale(size: tuple[int, int], height: int, width: int) -> float:
    """The factor that makes an image of (height, width) just cover `size` (H, W) of the model input."""
    return max(size[0] / height, size[1] / width)


def resize_pair(image: torch.Tensor, mask: torch.Tensor | None, out: tuple[int, int]):
    """image [C, H, W] (bilinear, antialiased) and mask [H, W] (nearest) resized to `out` (H, W)."""
    if tuple(image.shape[-2:]) == tuple(out):
        return image, mask
    image = F.interpolate(image[None], size=out, mode="bilinear", align_corners=False, antialias=True)[0]
    if mask is not None:  # float32 holds every index exactly; nearest-exact samples pixel centres
        mask = F.interpolate(mask[None, None].float(), size=out, mode="nearest-exact")[0, 0].long()
    return image, mask


def normalize_image(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[C, H, W] in [0, 1] -> normalised with per-channel `mean` and `std` ([C, 1, 1])."""
    return (image - mean) / std


class JointTrainTransform:
    """(image [C, H, W] in [0, 1], mask [H, W], generator) -> (normalised image [C, h, w], mask [h, w]) at the
    model input `size` (h, w); every random draw from `generator`, in a fixed order."""

    def __init__(self, size: tuple[int, int], *, mean, std, scale: tuple[float, float] = (0.5, 2.0),
                 hflip: float = 0.5) -> None:  # fmt: skip
        self.size, self.scale, self.hflip = tuple(size), tuple(scale), hflip
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor, mask: torch.Tensor, g: torch.Generator):
        (h, w), (height, width) = self.size, image.shape[-2:]
        factor = cover_scale(self.size, height, width) * torch.empty(()).uniform_(*self.scale, generator=g).item()
        out = (max(1, round(height * factor)), max(1, round(width * factor)))
        image, mask = resize_pair(image, mask, out)
        image = normalize_image(image, self.mean, self.std)
        pad_h, pad_w = max(0, h - out[0]), max(0, w - out[1])
        if pad_h or pad_w:  # 0 after normalising is the mean; the padding is ignored by loss and metrics
            image = F.pad(image, (0, pad_w, 0, pad_h))
            mask = F.pad(mask, (0, pad_w, 0, pad_h), value=IGNORE)
        top = int(torch.randint(0, image.shape[1] - h + 1, (), generator=g))
        left = int(torch.randint(0, image.shape[2] - w + 1, (), generator=g))
        image, mask = image[:, top : top + h, left : left + w], mask[top : top + h, left : left + w]
        if torch.rand((), generator=g).item() < self.hflip:
            image, mask = image.flip(-1), mask.flip(-1)
        return image.contiguous(), mask.contiguous()


class JointEvalTransform:
    """(image, mask, generator) -> (normalised image, mask), both at the image's own size."""

    def __init__(self, *, mean, std) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor, mask: torch.Tensor, g: torch.Generator | None = None):
        return normalize_image(image, self.mean, self.std), mask
