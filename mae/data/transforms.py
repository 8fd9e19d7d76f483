"""The pretraining sample: a random-resized crop, a flip and a mask, all drawn from (seed, epoch, index).

The mask is drawn here, once per sample, by the chosen mask generator; the model receives it as noise.

Drawing every random choice of a sample from its own seed (not from per-process RNG state) makes a
run give the same crops and masks whatever the number of processes or workers, and wherever it
was resumed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from mae.data.sources import ChannelError, check_channels
from mae.models.masking import mask_generator, num_visible

# The errors a broken image file raises on open or decode.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 63-bit seed for one sample of one epoch."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(2, np.uint64)[0] >> 1)


def load_image(source, index: int, in_chans: int = 3):
    """(image, None), or (None, {"bad": (name, reason)}) when the file cannot be decoded. Reporting
    travels with the batch so the training process warns once per file, whatever the workers.

    The image is PIL RGB for 3 channels (any mode converted, 8 bits), else a float tensor [C, H, W] in
    [0, 1] at the file's precision; a file with another channel count raises `ChannelError`."""
    try:
        if in_chans == 3:
            return source.load(index), None
        array = source.load_array(index)
        check_channels(array, in_chans, source.name(index))
        return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1), None
    except ChannelError:
        raise
    except DECODE_ERRORS as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        return None, {"bad": (source.name(index), reason)}


# Decoded images one process keeps (`DecodedImages`): a whole small set, e.g. 60,000 28-px images as float32
# take 188 MB; a set judged larger from its first image is never kept.
DECODED_BYTES = 256 * 2**20


def _nbytes(img) -> int:
    if isinstance(img, torch.Tensor):
        return img.numel() * img.element_size()
    return img.width * img.height * len(img.getbands())


class DecodedImages:
    """`load_image` that decodes each image once per process where the whole set fits in `budget` bytes
    (judged from the first image, and never more than `budget` kept). On 28-px images decoding (0.24 ms
    each) costs as much as the crop, flip and mask together; a large set is decoded every time, as before.
    Kept images are only read: every transform returns new images."""

    def __init__(self, source, in_chans: int, budget: int = DECODED_BYTES) -> None:
        self.source, self.in_chans, self.budget = source, in_chans, budget
        self.images: dict[int, object] | None = {}  # None: the set does not fit
        self.used = 0

    def __call__(self, index: int):
        images = self.images
        if images is not None and index in images:
            return images[index], None
        img, bad = load_image(self.source, index, self.in_chans)
        if bad is None and images is not None:
            size = _nbytes(img)
            if not images and size * len(self.source) > self.budget:
                self.images = None
            elif self.used + size <= self.budget:
                images[index], self.used = img, self.used + size
        return img, bad


def split_bad(samples: list[dict]) -> tuple[list[dict], list[tuple[str, str]]]:
    """(the good samples, [(name, reason)] of the files that failed)."""
    return [s for s in samples if "bad" not in s], [s["bad"] for s in samples if "bad" in s]


class PretrainSamples(torch.utils.data.Dataset):
    """`dataset[(epoch, index)]` -> {"image": [C, H, W], "noise": [L], "index": int} (uint8 for RGB, float in
    [0, 1] at the file's precision for other channel counts), or
    {"bad": (name, reason)} when the file cannot be decoded. `noise` comes from the `masking` generator
    (`mae.models.masking`): the model keeps the `int(L * (1 - mask_ratio))` patches of lowest noise."""

    def __init__(
        self,
        source,
        *,
        img_size: tuple[int, int],
        patch_size: int,
        seed: int,
        crop_scale: tuple[float, float] = (0.2, 1.0),
        hflip: bool = True,
        masking: str = "random",
        mask_ratio: float = 0.75,
        in_chans: int = 3,
    ) -> None:
        self.source = source
        self.in_chans = in_chans
        self.load = DecodedImages(source, in_chans)
        self.img_size = img_size
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.num_keep = num_visible(self.grid_size[0] * self.grid_size[1], mask_ratio)
        self.mask_generator = mask_generator(masking)
        self.seed = seed
        self.crop_scale = crop_scale
        self.hflip = hflip
        if hasattr(source, "set_decode_size"):
            # The smallest crop (area crop_scale[0], aspect 3/4) still gets full resolution at this size.
            source.set_decode_size(math.ceil(max(img_size) / math.sqrt(crop_scale[0] * 3 / 4)))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        img, bad = self.load(index)
        return bad if bad is not None else self.prepare(img, epoch, index)

    def prepare(self, img, epoch: int, index: int) -> dict:
        """A loaded image (PIL RGB, or a float tensor [C, H, W]) -> the sample; its crop, flip and mask drawn
        from (seed, epoch, index). Streams (`mae.data.streaming`) call this with their own positions."""
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed also queues CUDA seeding, which on a CUDA build
            # records a stack trace per call (half of this method's time on 28-px images).
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            top, left, h, w = RandomResizedCrop.get_params(img, scale=list(self.crop_scale), ratio=[3 / 4, 4 / 3])
            flip = self.hflip and torch.rand(()) < 0.5
            noise = self.mask_generator(self.grid_size, self.num_keep, torch.default_generator)
        img = F.resized_crop(
            img, top, left, h, w, list(self.img_size), interpolation=InterpolationMode.BICUBIC, antialias=True
        )
        if flip:
            img = F.horizontal_flip(img)
        return {"image": img if isinstance(img, torch.Tensor) else F.pil_to_tensor(img), "noise": noise, "index": index}


def collate_samples(samples: list[dict]) -> dict:
    """Stack the good samples; `bad` lists the files that failed to decode."""
    good, bad = split_bad(samples)
    if not good:
        return {"image": None, "noise": None, "index": None, "bad": bad}
    return {
        "image": torch.stack([s["image"] for s in good]),
        "noise": torch.stack([s["noise"] for s in good]),
        "index": torch.tensor([s["index"] for s in good]),
        "bad": bad,
    }


def normalize(
    images: torch.Tensor, mean: tuple[float, ...] | torch.Tensor, std: tuple[float, ...] | torch.Tensor
) -> torch.Tensor:
    """[N, C, H, W] uint8 (RGB, 4x less to transfer) or float in [0, 1] -> float, normalised; done on the
    training device. `mean` and `std` may be tensors already on that device (no copy per batch)."""
    m = torch.as_tensor(mean, device=images.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, device=images.device).view(1, -1, 1, 1)
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    return (x - m) / s


def denormalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """The inverse of `normalize`, as floats in [0, 1]."""
    m = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    return (images * s + m).clamp(0, 1)
