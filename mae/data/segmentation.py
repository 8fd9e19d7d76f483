"""Images with per-pixel class masks, for `mae segment`: the folder layout (`images/NAME.<ext>` beside
`masks/NAME.png`, pixel value = class index, 255 = ignore, palette PNGs read as their indices, an optional
`classes.txt`), `open_segmentation` (a folder, or a `datasets` dataset: `mae.data.segmentation_hf`), and the samples
whose augmentations move the image and its mask together.

Every mask is read once when the source is opened (`MaskedSource.check_masks`): a mask of the wrong size, an index
beyond the classes or a missing mask stops the run before it trains, with the file (or row and column) named.
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

from mae.data.folder import FolderSource
from mae.data.hf import DATASET_LABEL
from mae.data.images import iter_image_files
from mae.data.masks import MaskedSource, read_mask
from mae.data.open import dataset_named, is_dataset, is_dataset_object
from mae.data.segmentation_hf import SegmentationHF
from mae.data.transforms import DecodedImages, sample_seed
from mae.errors import DataError

IMAGES, MASKS, CLASS_NAMES = "images", "masks", "classes.txt"


def is_segmentation_folder(path: Any) -> bool:
    """A folder with `images/` and `masks/` subfolders."""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / IMAGES).is_dir() and (Path(path) / MASKS).is_dir()


def _image_size(path: str) -> tuple[int, int]:
    """(height, width) of an image file without decoding it."""
    if path.lower().endswith(".npy"):
        shape = np.load(path, mmap_mode="r").shape
        return int(shape[0]), int(shape[1])
    with Image.open(path) as img:
        return img.height, img.width


class SegmentationFolder(MaskedSource):
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
        self.classes = self.check_masks(classes, num_classes, CLASS_NAMES)

    def _mask_of(self, image: str) -> str:
        rel = Path(image).relative_to(self.root / IMAGES).with_suffix(".png")
        mask = self.root / MASKS / rel
        if not mask.is_file():
            raise DataError(f"{image}: no mask {mask}; every image needs masks/<same name>.png (or remove the image)")
        return str(mask)

    def read_mask(self, i: int) -> tuple[np.ndarray, list[int] | None]:
        return read_mask(self.masks[i])

    def image_size(self, i: int) -> tuple[int, int]:
        return _image_size(str(self.images.paths[i]))

    def mask_name(self, i: int) -> str:
        return self.masks[i]

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


def open_segmentation(path: Any, *, num_classes: int | None, option: str, classes: list[str] | None = None,
                      image_column: str | None = None, mask_column: str | None = None) -> MaskedSource:  # fmt: skip
    """The segmentation source at `path`: a folder with images/ and masks/ (`classes` overriding its classes.txt),
    or a `datasets` dataset (`hf:NAME[:split]`, a `save_to_disk` folder, the object) read through its image and mask
    columns; a one-line `DataError` for anything else."""
    if is_dataset(path):
        label = DATASET_LABEL if is_dataset_object(path) else path
        return SegmentationHF(dataset_named(path, option), image_column=image_column, mask_column=mask_column,
                              label=label, num_classes=num_classes)  # fmt: skip
    if not isinstance(path, str) or not Path(path).is_dir():
        raise DataError(f"{option} {path}: no such folder; give a folder with images/ and masks/, or a `datasets` "
                        "dataset (a save_to_disk folder or hf:NAME[:split])")  # fmt: skip
    return SegmentationFolder(path, num_classes=num_classes, option=option, classes=classes)


def split_segmentation(source: MaskedSource, fraction: float, seed: int) -> tuple[MaskedSource, MaskedSource]:
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

    def __init__(self, source: MaskedSource, transform: Callable, seed: int = 0, in_chans: int = 3) -> None:
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
