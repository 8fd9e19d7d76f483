"""Samples from images: the pretraining sample (a random-resized crop, a flip and a mask, all drawn from
(seed, epoch, index)), the downstream stages' transforms (timm's), the batches both make, and normalisation.

The mask is drawn here, once per sample, by the chosen mask generator; the model receives it as noise.

Drawing every random choice of a sample from its own seed (not from per-process RNG state) makes a
run give the same crops and masks whatever the number of processes or workers, and wherever it
was resumed.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from mae.data.images import DECODE_ERRORS, check_channels
from mae.errors import ChannelError
from mae.models.masking import mask_generator, num_visible

# numpy's SeedSequence hash (numpy/random/bit_generator.pyx), all arithmetic on 32-bit words.
_M32 = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _POOL = 0xCA01F9DD, 0x4973F715, 4


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-mixed 63-bit seed for one sample of one epoch: the first 64-bit word of
    `np.random.SeedSequence([seed, epoch, index]).generate_state(2, np.uint64)`, shifted right once.

    Computed here in plain Python: the numpy object costs ~40 us a call, a sixth of a whole 28-px
    sample. The same values (tests/data/test_transforms.py compares them), so runs draw what they drew."""
    words = []  # numpy's _coerce_to_uint32_array: each non-negative int as little-endian 32-bit words
    for v in (seed, epoch, index):
        if v < 0:
            raise ValueError(f"sample_seed takes non-negative integers, got {v}")
        words.append(v & _M32)
        while v > _M32:
            v >>= 32
            words.append(v & _M32)
    const = _INIT_A

    def hashmix(value: int) -> int:
        nonlocal const
        value ^= const
        const = (const * _MULT_A) & _M32
        value = (value * const) & _M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        r = (_MIX_L * x - _MIX_R * y) & _M32
        return r ^ (r >> 16)

    pool = [hashmix(words[i] if i < len(words) else 0) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for word in words[_POOL:]:
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(word))
    out, const = [], _INIT_B
    for value in pool[:2]:  # generate_state: the first two 32-bit words make the first 64-bit one
        value ^= const
        const = (const * _MULT_B) & _M32
        value = (value * const) & _M32
        out.append(value ^ (value >> 16))
    return (out[0] | out[1] << 32) >> 1


@functools.lru_cache
def _log_ratio(ratio: tuple[float, float]) -> tuple[float, float]:
    return tuple(torch.log(torch.tensor(ratio)).tolist())  # float32, as torchvision takes them


def crop_params(
    size: tuple[int, int], scale: tuple[float, float], ratio: tuple[float, float], generator: torch.Generator
) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random-resized crop of an image of `size` (H, W): torchvision's
    `RandomResizedCrop.get_params` drawing from `generator`, the same draws in the same order. A private
    generator spares swapping the global RNG state around each sample (a third of a 28-px sample's time)."""
    height, width = size
    area = height * width
    log_ratio = _log_ratio(tuple(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            j = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            return i, j, h, w
    in_ratio = width / height  # the fallback: a central crop
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(img, top: int, left: int, h: int, w: int, size: tuple[int, int]):
    """Crop and resize (bicubic, antialiased) as torchvision's `resized_crop` does; a float tensor [C, H, W]
    goes straight to `interpolate` (the same kernel, without the dispatch that costs half as much again)."""
    if not isinstance(img, torch.Tensor) or img.dtype not in (torch.float32, torch.float64):
        return F.resized_crop(img, top, left, h, w, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)
    img = img[:, top : top + h, left : left + w]
    if (h, w) == tuple(size):
        return img
    return torch.nn.functional.interpolate(
        img[None], size=list(size), mode="bicubic", align_corners=False, antialias=True
    )[0]


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


def decode_side(size: tuple[int, int], smallest_crop: float) -> int:
    """The short side a JPEG may be decoded down to (`BaseSource.set_decode_size`) when a crop of
    `smallest_crop` of the image's side, resized to `size`, must keep full resolution."""
    return math.ceil(max(size) / smallest_crop)


def crop_decode_side(size: tuple[int, int], min_scale: float) -> int:
    """`decode_side` for random-resized crops of at least `min_scale` of the area: the narrowest such crop (aspect
    3/4) spans sqrt(min_scale x 3/4) of the short side."""
    return decode_side(size, math.sqrt(min_scale * 3 / 4))


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
        self.generator = torch.Generator()  # reseeded per sample
        # The smallest crop (area crop_scale[0], aspect 3/4) still gets full resolution at this size.
        source.set_decode_size(crop_decode_side(img_size, crop_scale[0]))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        img, bad = self.load(index)
        return bad if bad is not None else self.prepare(img, epoch, index)

    def prepare(self, img, epoch: int, index: int) -> dict:
        """A loaded image (PIL RGB, or a float tensor [C, H, W]) -> the sample; its crop, flip and mask drawn
        from (seed, epoch, index). Streams (`mae.data.streaming`) call this with their own positions."""
        g = self.generator
        g.manual_seed(sample_seed(self.seed, epoch, index))
        top, left, h, w = crop_params(F.get_size(img), self.crop_scale, (3 / 4, 4 / 3), g)
        flip = self.hflip and torch.rand((), generator=g) < 0.5
        noise = self.mask_generator(self.grid_size, self.num_keep, g)
        img = resized_crop(img, top, left, h, w, self.img_size)
        if flip:
            img = F.horizontal_flip(img)
        return {"image": img if isinstance(img, torch.Tensor) else F.pil_to_tensor(img), "noise": noise, "index": index}


def _collate(samples: list[dict], keys: tuple[str, ...]) -> dict:
    """torch's `default_collate` of the good samples' `keys`; `bad` lists the files that failed to decode
    ([(name, reason)]), and a batch with no good sample has None for each key."""
    good = [{k: s[k] for k in keys} for s in samples if "bad" not in s]
    batch = default_collate(good) if good else dict.fromkeys(keys)
    return {**batch, "bad": [s["bad"] for s in samples if "bad" in s]}


def collate_samples(samples: list[dict]) -> dict:
    """Pretraining samples -> {"image": [N, C, H, W], "noise": [N, L], "index": [N], "bad": [(name, reason)]}."""
    return _collate(samples, ("image", "noise", "index"))


def collate_labeled(samples: list[dict]) -> dict:
    """Labeled samples -> {"image": [N, C, H, W], "label": [N], "index": [N], "bad": [(name, reason)]}."""
    return _collate(samples, ("image", "label", "index"))


def collate_images(samples: list[dict]) -> dict:
    """Unlabeled samples -> {"image": [N, C, H, W], "index": [N], "bad": [(name, reason)]}."""
    return _collate(samples, ("image", "index"))


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


def eval_transform(size: tuple[int, int], *, crop_pct: float, mean: tuple, std: tuple, in_chans: int = 3) -> Callable:
    """Evaluation: resize to size / crop_pct, centre-crop `size`, normalise. timm's for RGB (PIL in);
    the same steps on float tensors [C, H, W] for any other channel count."""
    if in_chans == 3:
        from timm.data import create_transform

        return create_transform(
            (3, *size), is_training=False, crop_pct=crop_pct, interpolation="bicubic", mean=mean, std=std
        )
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(math.floor(min(size) / crop_pct), interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
            v2.CenterCrop(list(size)),
            v2.Normalize(list(mean), list(std)),
        ]
    )


def train_transform(
    size: tuple[int, int],
    *,
    scale: tuple[float, float],
    mean: tuple,
    std: tuple,
    auto_augment: str | None = None,
    re_prob: float = 0.0,
    in_chans: int = 3,
) -> Callable:
    """timm's training transform (random-resized crop, flip, optional RandAugment and random erasing),
    bicubic, with posterize made safe on Pillow >= 13 (see `_posterize`). For another channel count the
    crop, flip and random erasing run on float tensors; RandAugment, whose ops are RGB image ops, is left
    out (warned)."""
    if in_chans != 3:
        from timm.data.random_erasing import RandomErasing
        from torchvision.transforms import v2

        if auto_augment:
            warnings.warn(f"{in_chans}-channel images: RandAugment ({auto_augment}) works on RGB only, left out",
                          stacklevel=2)  # fmt: skip
        steps = [
            v2.RandomResizedCrop(
                list(size), scale=tuple(scale), interpolation=v2.InterpolationMode.BICUBIC, antialias=True
            ),
            v2.RandomHorizontalFlip(),
            v2.Normalize(list(mean), list(std)),
        ]
        if re_prob > 0:
            steps.append(RandomErasing(re_prob, mode="pixel", max_count=1, device="cpu"))
        return v2.Compose(steps)
    from timm.data import create_transform

    transform = create_transform(
        (3, *size),
        is_training=True,
        scale=tuple(scale),
        hflip=0.5,
        color_jitter=None,
        auto_augment=auto_augment,
        re_prob=re_prob,
        re_mode="pixel",
        re_count=1,
        interpolation="bicubic",
        mean=mean,
        std=std,
    )
    from timm.data.auto_augment import posterize

    for t in getattr(transform, "transforms", []):
        policy = getattr(t, "ops", None) or [op for sub in getattr(t, "policy", []) for op in sub]
        for op in policy:
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize
    return transform


def _posterize(img, bits_to_keep: int, **kwargs):
    """timm's posterize, keeping the reference meaning of 0 bits (a black image: TF's shift by 8, and
    Pillow before 13). Pillow 13 refuses 0 bits, and the increasing posterize of `rand-m9-mstd0.5-inc1`
    asks for 0 when the sampled magnitude reaches 10."""
    from timm.data.auto_augment import posterize

    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)
