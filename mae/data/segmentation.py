"""Images with per-pixel class masks, for `mae segment`: the folder layout (`images/NAME.<ext>` beside
`masks/NAME.png`, pixel value = class index, 255 = ignore, palette PNGs read as their indices, an optional
`classes.txt`), its checks (one line naming the file), and the samples whose augmentations move the image and its
mask together.

Every mask is read once when the folder is opened: a mask of the wrong size, an index beyond the classes or a
missing mask stops the run before it trains, with the file named.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from mae.data.base import BaseSource
from mae.data.folder import FolderSource
from mae.data.images import DECODE_ERRORS, iter_image_files
from mae.data.transforms import DecodedImages, sample_seed
from mae.errors import DataError

IGNORE = 255  # the mask value that no loss, metric or class counts
IMAGES, MASKS, CLASS_NAMES = "images", "masks", "classes.txt"
_MASK_MODES = ("L", "P", "I", "I;16", "1")  # one band of indices (P: a palette's indices)


def is_segmentation_folder(path: Any) -> bool:
    """A folder with `images/` and `masks/` subfolders."""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / IMAGES).is_dir() and (Path(path) / MASKS).is_dir()


def read_mask(path: str) -> tuple[np.ndarray, list[int] | None]:
    """(class indices [H, W] int64, the palette as flat RGB values or None) of a mask PNG: 8- or 16-bit
    grayscale values, or a palette image's indices (its colours kept for the outputs)."""
    with Image.open(path) as img:
        if img.mode not in _MASK_MODES:
            raise DataError(
                f"{path}: a mask must hold one class index per pixel (a grayscale or palette PNG), not mode "
                f"{img.mode}; save the indices as an 8-bit PNG (or a palette PNG)"
            )
        palette = img.getpalette() if img.mode == "P" else None
        return np.asarray(img, dtype=np.int64), palette


def _image_size(path: str) -> tuple[int, int]:
    """(height, width) of an image file without decoding it."""
    if path.lower().endswith(".npy"):
        shape = np.load(path, mmap_mode="r").shape
        return int(shape[0]), int(shape[1])
    with Image.open(path) as img:
        return img.height, img.width


class SegmentationFolder(BaseSource):
    """`root/images/**/NAME.<ext>` with `root/masks/**/NAME.png` (the same relative path): images as every
    folder source gives them (`load`, `load_array`, `name`), masks through `load_mask`. `classes` from
    `classes.txt` (one name a line), else `num_classes`, else the largest index seen + 1 (named "0", "1", ...)."""

    def __init__(self, root: str | os.PathLike, *, num_classes: int | None = None, option: str = "--data.path",
                 classes: list[str] | None = None) -> None:  # fmt: skip
        self.root, self.option = Path(root), option
        if not is_segmentation_folder(root):
            raise DataError(f"{option} {root}: a segmentation folder holds images/ and masks/ (same file names)")
        self.images = FolderSource(self.root / IMAGES, option=option)
        self.masks = [self._mask_of(p) for p in self.images.paths]
        named = self.root / CLASS_NAMES
        if classes is None and named.is_file():
            classes = [line.strip() for line in named.read_text().splitlines() if line.strip()]
        self.palette: list[int] | None = None
        self.classes = self._check_masks(classes, num_classes)

    def _mask_of(self, image: str) -> str:
        rel = Path(image).relative_to(self.root / IMAGES).with_suffix(".png")
        mask = self.root / MASKS / rel
        if not mask.is_file():
            raise DataError(f"{image}: no mask {mask}; every image needs masks/<same name>.png (or remove the image)")
        return str(mask)

    def _check_masks(self, classes: list[str] | None, num_classes: int | None) -> list[str]:
        """Every mask read once: its size against its image's, its indices against the classes."""
        limit = len(classes) if classes is not None else num_classes
        top = 0
        for image, mask in zip(self.images.paths, self.masks, strict=True):
            try:
                indices, palette = read_mask(mask)
                size = _image_size(str(image))
            except DataError:
                raise
            except DECODE_ERRORS as e:
                raise DataError(f"{mask}: cannot be read ({type(e).__name__}: {e})".splitlines()[0]) from None
            if indices.shape != size:
                raise DataError(f"{mask}: mask is {indices.shape[1]}x{indices.shape[0]} (WxH) but its image {image} "
                                f"is {size[1]}x{size[0]}; masks must match their images pixel for pixel")  # fmt: skip
            seen = indices[indices != IGNORE]
            high = int(seen.max()) if seen.size else -1
            if limit is not None and high >= limit:
                where = f"{CLASS_NAMES} names {limit}" if classes is not None else f"--data.num_classes is {limit}"
                raise DataError(f"{mask}: class index {high} but {where} (0 to {limit - 1}; {IGNORE} = ignore); "
                                "fix the mask or the class list")  # fmt: skip
            top = max(top, high)
            self.palette = self.palette or palette
        if classes is not None:
            return classes
        return [str(i) for i in range(num_classes or top + 1)]

    def subset(self, rows: np.ndarray) -> SegmentationFolder:
        """The same folder restricted to `rows` (a held-out split), classes kept."""
        part = object.__new__(SegmentationFolder)
        part.__dict__.update(self.__dict__)
        part.images = FolderSource(self.images.root, paths=list(self.images.paths[rows]), option=self.option)
        part.masks = [self.masks[i] for i in rows]
        return part

    def __len__(self) -> int:
        return len(self.images)

    def load(self, i: int) -> Image.Image:
        return self.images.load(i)

    def load_array(self, i: int) -> np.ndarray:
        return self.images.load_array(i)

    def name(self, i: int) -> str:
        return self.images.name(i)

    def load_mask(self, i: int) -> np.ndarray:
        """Mask `i` as class indices [H, W] int64 (255 = ignore)."""
        return read_mask(self.masks[i])[0]


def open_segmentation(path: str, *, num_classes: int | None, option: str, classes: list[str] | None = None):
    """The segmentation source at `path`; a one-line `DataError` for anything else."""
    if not isinstance(path, str) or not Path(path).is_dir():
        raise DataError(f"{option} {path}: no such folder; give a folder with images/ and masks/")
    return SegmentationFolder(path, num_classes=num_classes, option=option, classes=classes)


def split_segmentation(source: SegmentationFolder, fraction: float, seed: int):
    """(train, held-out) with `fraction` of the images held out, chosen by `seed`."""
    order = np.random.default_rng(seed).permutation(len(source))
    n_val = max(1, round(fraction * len(source)))
    return source.subset(np.sort(order[n_val:])), source.subset(np.sort(order[:n_val]))


def image_tensor(img: Any) -> torch.Tensor:
    """A loaded image (PIL RGB, or a float tensor [C, H, W] in [0, 1]) as a float tensor [C, H, W] in [0, 1]."""
    if isinstance(img, torch.Tensor):
        return img.float()
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


class SegmentationSamples(torch.utils.data.Dataset):
    """`dataset[(epoch, index)]` or `dataset[index]` -> {"image": [C, H, W] float, "mask": [H, W] int64, "index"},
    or {"bad": (name, reason)} for an image that cannot be decoded. `transform(image, mask, generator)` gets a
    generator seeded from (seed, epoch, index), so any number of processes and any resume draw the same."""

    def __init__(self, source: SegmentationFolder, transform: Callable, seed: int = 0, in_chans: int = 3) -> None:
        self.source, self.transform, self.seed, self.in_chans = source, transform, seed, in_chans
        self.load = DecodedImages(source, in_chans)
        self.generator = torch.Generator()

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        img, bad = self.load(index)
        if bad is not None:
            return bad
        self.generator.manual_seed(sample_seed(self.seed, epoch, index))
        mask = torch.from_numpy(self.source.load_mask(index))
        image, mask = self.transform(image_tensor(img), mask, self.generator)
        return {"image": image, "mask": mask, "index": index}


def collate_segments(samples: list[dict]) -> dict:
    """Samples of one size -> {"image": [N, C, H, W], "mask": [N, H, W], "index": [N], "bad": [(name, reason)]};
    samples of different sizes (evaluation at each image's own size) -> lists instead of stacked tensors."""
    good = [{k: s[k] for k in ("image", "mask", "index")} for s in samples if "bad" not in s]
    bad = [s["bad"] for s in samples if "bad" in s]
    if not good:
        return {"image": None, "mask": None, "index": None, "bad": bad}
    if len({s["image"].shape for s in good}) == 1:
        return {**default_collate(good), "bad": bad}
    return {k: [s[k] for s in good] for k in ("image", "mask", "index")} | {"bad": bad}


def list_images(path: str) -> list[str]:
    """The images of a segmentation folder (its images/) or of any folder."""
    root = Path(path) / IMAGES if is_segmentation_folder(path) else Path(path)
    return sorted(iter_image_files(root))
