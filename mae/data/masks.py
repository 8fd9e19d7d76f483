"""Per-pixel class masks (`mae segment`): a mask read as class indices (a grayscale or palette image, or an
integer array; 255 = ignore), and `MaskedSource`, the base of every segmentation source, whose `check_masks`
reads all its masks once when it is opened: each mask the size of its image, no index beyond the classes, and
one line naming the mask otherwise, whatever kind of source holds it (a folder, a `datasets` column).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from mae.data.base import BaseSource
from mae.data.images import DECODE_ERRORS
from mae.errors import DataError

IGNORE = 255  # the mask value that no loss, metric or class counts
_MASK_MODES = ("L", "P", "I", "I;16", "1")  # one band of indices (P: a palette's indices)


def mask_indices(mask: Image.Image | np.ndarray | list, name: str) -> tuple[np.ndarray, list[int] | None]:
    """(class indices [H, W] int64, the palette as flat RGB values or None) of a mask: an image of 8- or 16-bit
    grayscale values or a palette image's indices (its colours kept for the outputs), or an H x W integer array.
    `name` names the mask in the one-line error."""
    if isinstance(mask, Image.Image):
        if mask.mode not in _MASK_MODES:
            raise DataError(
                f"{name}: a mask must hold one class index per pixel (a grayscale or palette PNG), not mode "
                f"{mask.mode}; save the indices as an 8-bit PNG (or a palette PNG)"
            )
        palette = mask.getpalette() if mask.mode == "P" else None
        return np.asarray(mask, dtype=np.int64), palette
    a = np.asarray(mask)
    if a.ndim != 2 or not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
        raise DataError(
            f"{name}: a mask must hold one class index per pixel, an H x W array of integers, not {a.dtype} of "
            f"shape {a.shape}; store the indices as an 8-bit PNG or an integer array"
        )
    return a.astype(np.int64), None


def read_mask(path: str) -> tuple[np.ndarray, list[int] | None]:
    """`mask_indices` of a mask file (a PNG)."""
    with Image.open(path) as img:
        return mask_indices(img, path)


class MaskedSource(BaseSource):
    """Images, each with a mask of class indices: what `SegmentationSamples` reads. A subclass gives the images
    (`__len__`, `load`, `load_array`, `name`) and, for image `i`: `read_mask(i)` (`mask_indices`, or a one-line
    `DataError` naming the mask), `image_size(i)` (decoding as little as it can), `mask_name(i)` (the mask in
    messages) and `subset(rows)`; it sets `classes` with `check_masks`."""

    classes: list[str]
    palette: list[int] | None = None  # the first palette mask's colours (flat RGB), kept for the outputs
    named: bool = False  # the data names its classes (classes.txt, a ClassLabel); else they are counted

    def read_mask(self, i: int) -> tuple[np.ndarray, list[int] | None]:
        raise NotImplementedError

    def image_size(self, i: int) -> tuple[int, int]:
        """(height, width) of image `i`."""
        raise NotImplementedError

    def mask_name(self, i: int) -> str:
        raise NotImplementedError

    def subset(self, rows: np.ndarray) -> MaskedSource:
        """The same source restricted to `rows` (a held-out split), classes kept."""
        raise NotImplementedError

    def load_mask(self, i: int) -> np.ndarray:
        """Mask `i` as class indices [H, W] int64 (255 = ignore)."""
        return self.read_mask(i)[0]

    def check_masks(self, classes: list[str] | None, num_classes: int | None, named_by: str) -> list[str]:
        """Every mask read once: its size against its image's, its indices against the classes. Returns the
        classes: `classes` (named by `named_by`, e.g. "classes.txt", in messages), else `num_classes` or the
        largest index seen + 1, named "0", "1", ..."""
        limit = len(classes) if classes is not None else num_classes
        top = 0
        for i in range(len(self)):
            mask = self.mask_name(i)
            try:
                indices, palette = self.read_mask(i)
                size = self.image_size(i)
            except DataError:
                raise
            except DECODE_ERRORS as e:
                raise DataError(f"{mask}: cannot be read ({type(e).__name__}: {e})".splitlines()[0]) from None
            if indices.shape != size:
                raise DataError(f"{mask}: mask is {indices.shape[1]}x{indices.shape[0]} (WxH) but its image "
                                f"{self.name(i)} is {size[1]}x{size[0]}; masks must match their images pixel for "
                                "pixel")  # fmt: skip
            seen = indices[indices != IGNORE]
            low, high = (int(seen.min()), int(seen.max())) if seen.size else (0, -1)
            if low < 0:
                raise DataError(f"{mask}: class index {low}; indices run from 0 and {IGNORE} marks the pixels to "
                                "ignore; fix the mask")  # fmt: skip
            if limit is not None and high >= limit:
                where = f"{named_by} names {limit}" if classes is not None else f"--data.num_classes is {limit}"
                raise DataError(f"{mask}: class index {high} but {where} (0 to {limit - 1}; {IGNORE} = ignore); "
                                "fix the mask or the class list")  # fmt: skip
            top = max(top, high)
            self.palette = self.palette or palette
        self.named = classes is not None
        return classes if classes is not None else [str(i) for i in range(num_classes or top + 1)]
