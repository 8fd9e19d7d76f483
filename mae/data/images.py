"""Image readers, the leaf of `mae.data`: files (or a shard member's bytes) as PIL RGB images or as [H, W, C]
float arrays at their stored precision and channel count (grayscale, 16-bit, multispectral).

Every source kind reads its images through these; this module imports nothing else of `mae.data`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from mae.errors import ChannelError, DataError

IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .webp .avif .bmp .tif .tiff .gif .ppm .pgm .pbm .pnm .npy".split()
)
# The errors a broken image file raises on open or decode.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError)


def check_channels(array: np.ndarray, in_chans: int, name: str) -> None:
    if array.shape[2] != in_chans:
        hint = "give every image that many channels, or set --model.in_chans to match"
        if array.shape[0] == in_chans and name.lower().endswith(".npy"):  # bands first, as torch lays them out
            hint = (
                f"its shape {tuple(array.shape)} looks like C x H x W; save arrays as H x W x C (np.moveaxis(a, 0, -1))"
            )
        raise ChannelError(f"{name}: {array.shape[2]} channel(s), but --model.in_chans is {in_chans}; {hint}")


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL image -> RGB: EXIF orientation applied; 16-bit and float scaled, not clipped."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        scale = 65535.0 if img.mode.startswith("I;16") or a.max() > 255 else 255.0
        img = Image.fromarray(np.clip(a / scale * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L")
    if img.mode in ("P", "PA", "LA", "RGBA"):
        img = img.convert("RGBA")
    return img.convert("RGB")


# PIL modes that are one band of data; every other mode but RGB(A) and LA is colour, read as RGB.
_SINGLE_BAND = ("L", "I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def pil_array(img: Image.Image) -> np.ndarray:
    """A PIL image as [H, W, C] at its stored precision (EXIF orientation applied): one band for grayscale
    of any depth, RGB(A) as 3 (4) bands, other colour modes converted to RGB."""
    img = ImageOps.exif_transpose(img)
    if img.mode == "1":
        img = img.convert("L")
    elif img.mode not in (*_SINGLE_BAND, "RGB", "RGBA", "LA"):
        img = img.convert("RGBA" if img.mode in ("P", "PA") and "transparency" in img.info else "RGB")
    return np.asarray(img)


def image_array(a: np.ndarray, name: str) -> np.ndarray:
    """[H, W, C] float32 in [0, 1] from any stored array: 8-bit / 255, 16-bit / 65535 (full precision, never
    through 8 bits), floats as stored. H x W arrays get one channel."""
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3:
        raise DataError(f"{name}: an image array must be H x W or H x W x C, not of shape {tuple(a.shape)}")
    if a.dtype == np.uint8 or a.dtype == bool:
        return a.astype(np.float32) / (1.0 if a.dtype == bool else 255.0)
    if np.issubdtype(a.dtype, np.integer):  # 16-bit data (PIL reads some 16-bit PNGs as 32-bit "I")
        return a.astype(np.float32) / 65535.0
    return a.astype(np.float32, copy=False)


def read_array(path: str, fp: BinaryIO | None = None) -> np.ndarray:
    """A file as [H, W, C] float32: `.npy` arrays (H x W x C), TIFFs of bands (`tiff_bands`), everything else
    (TIFF pictures included) through PIL (`pil_array`). With `fp`, the bytes are read
    from it (a member of a shard) and `path` only gives the format (its suffix) and the name in errors."""
    a = stored_bands(path, fp)
    if a is None:
        with Image.open(fp or path) as img:
            a = pil_array(img)
    return image_array(a, path)


def stored_bands(path: str, fp: BinaryIO | None = None) -> np.ndarray | None:
    """The array a `.npy` file or a TIFF of bands (`tiff_bands`) holds, as stored; None for pictures (other
    formats, TIFF pictures), which PIL decodes."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        return np.load(fp or path, allow_pickle=False)
    return tiff_bands(fp or path) if suffix in (".tif", ".tiff") else None


def tiff_bands(src: str | BinaryIO) -> np.ndarray | None:
    """A TIFF's bands as stored (tifffile: any band count and depth, planar C x H x W transposed, alpha
    dropped), or None where the file is a picture PIL reads as a viewer shows it: colour
    encodings (palette, CMYK, YCbCr, Lab, inverted grayscale) and compressions tifffile decodes only with
    `imagecodecs` (LZW, JPEG, CCITT fax: the common ones for photos and scans)."""
    import tifffile

    if not isinstance(src, str):
        start = src.tell()
    try:
        with tifffile.TiffFile(src) as tif:
            page = tif.pages[0]
            if page.photometric not in (tifffile.PHOTOMETRIC.MINISBLACK, tifffile.PHOTOMETRIC.RGB):
                return None
            colour = 3 if page.photometric == tifffile.PHOTOMETRIC.RGB else 1
            # an RGB image's extra samples, and a grayscale one's alpha, are transparency, not bands of data
            alpha = colour == 3 and len(page.extrasamples) > 0 or any(e in (1, 2) for e in page.extrasamples)
            try:
                a = tif.asarray()  # the first series: every page of a band-per-page file
            except ValueError:  # a codec that needs imagecodecs (tifffile names it); PIL has its own
                return None
    finally:
        if not isinstance(src, str):
            src.seek(start)
    if a.ndim == 3 and a.shape[0] < min(a.shape[1:]) and a.shape[-1] > 32:  # bands first
        a = np.moveaxis(a, 0, -1)
    if alpha:
        a = a[..., :colour]
    return a


def read_rgb(path: str, fp: BinaryIO | None = None, decode_side: int | None = None) -> Image.Image:
    """A file as a PIL RGB image (`to_rgb`); arrays (.npy, TIFF bands) must hold 1 or 3 channels. JPEGs larger
    than `decode_side` decode at a reduced scale (see `BaseSource.set_decode_size`). `fp` as for `read_array`."""
    bands = stored_bands(path, fp)
    if bands is not None:  # arrays of any band count: RGB must be 3 (or 1)
        a = image_array(bands, path)
        rgb = a.repeat(3, axis=2) if a.shape[2] == 1 else a
        check_channels(rgb, 3, path)
        return Image.fromarray(np.round(np.clip(rgb, 0, 1) * 255).astype(np.uint8))
    with Image.open(fp or path) as img:
        if decode_side and img.format == "JPEG" and min(img.size) > decode_side:
            scale = decode_side / min(img.size)
            img.draft("RGB", (math.ceil(img.width * scale), math.ceil(img.height * scale)))
        img.load()
        return to_rgb(img)


def iter_image_files(root: str | os.PathLike) -> Iterator[str]:
    """Every image file below `root`, recursively, following no symlinked folders."""
    stack = [os.fspath(root)]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            warnings.warn(f"skipping folder {folder}: {e.strerror or e}", stacklevel=2)
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                yield entry.path
