"""Image sources behind one interface: `len(source)`, `source.load(i) -> PIL RGB image`, `source.name(i)`,
and `source.load_array(i) -> [H, W, C]` for any channel count (grayscale, 16-bit, multispectral).

- an unlabeled folder: recursive, any nesting, listed with `os.scandir` (no copies, no decoding);
- a Hugging Face `datasets` dataset: `hf:NAME[:split]` or a `save_to_disk` folder;
- a WebDataset shard set (`mae.data.shards`): a folder with `index.json`, a brace pattern or URLs;
- no path: the demo photos that ship inside scikit-image.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps

from mae.errors import ChannelError, DataError  # noqa: F401

IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .webp .avif .bmp .tif .tiff .gif .ppm .pgm .pbm .pnm .npy".split()
)
# scikit-image's bundled photos (CC0 / public domain), loaded without any download.
DEMO_IMAGES = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "camera",
    "coins",
    "moon",
    "clock",
    "grass",
    "gravel",
    "brick",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "cat",
)
DEMO_REPEATS = 16  # each photo appears this often per epoch, each time with its own crop


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
    than `decode_side` decode at a reduced scale (see `FolderSource.set_decode_size`). `fp` as for `read_array`."""
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


class FolderSource:
    """Every image below a folder, in sorted path order (labels, if any, are ignored)."""

    def __init__(self, root: str | os.PathLike, paths: list[str] | None = None) -> None:
        self.root = Path(root)
        self.decode_side: int | None = None
        # A NumPy string array keeps 1M paths compact and cheap to send to worker processes.
        self.paths = np.array(sorted(iter_image_files(self.root)) if paths is None else paths)
        if len(self.paths) == 0:
            exts = ", ".join(sorted(IMAGE_EXTENSIONS))
            raise DataError(f"--data.path {self.root}: no images found (looked recursively for {exts})")

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return str(self.paths[i])

    def set_decode_size(self, side: int | None) -> None:
        """Let JPEGs decode at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) while their short side stays
        >= `side`: a 12 MP photo cropped to 224 px needs a fraction of its pixels, and decoding them all
        costs more than the training step."""
        self.decode_side = side

    def load_array(self, i: int) -> np.ndarray:
        return read_array(str(self.paths[i]))

    def raw(self, i: int) -> tuple[bytes, str]:
        """(the file's bytes, its extension) (for `mae shard`)."""
        path = str(self.paths[i])
        return Path(path).read_bytes(), os.path.splitext(path)[1].lower().lstrip(".")

    def load(self, i: int) -> Image.Image:
        return read_rgb(str(self.paths[i]), decode_side=self.decode_side)


def is_text(feature) -> bool:
    """Whether a `datasets` column holds text: image file paths in an image column (cast to datasets' `Image`
    feature), class names in a label column (cast to a `ClassLabel`)."""
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


class HFSource:
    """A `datasets.Dataset`, read through its image column (images, arrays, or file paths)."""

    def __init__(self, dataset, image_column: str | None, label: str) -> None:
        from datasets import Image as ImageFeature

        self.label = label
        columns = [c for c, f in dataset.features.items() if isinstance(f, ImageFeature)]
        if image_column is None:
            if not columns:
                raise DataError(
                    f"{label}: no image column (columns: {list(dataset.features)}); set --data.image_column"
                )
            image_column = columns[0]
        elif image_column not in dataset.features:
            raise DataError(f"--data.image_column {image_column}: not in {label} (columns: {list(dataset.features)})")
        self.column = image_column
        self.dataset = dataset.select_columns([image_column])
        if is_text(dataset.features[image_column]):
            self.dataset = self.dataset.cast_column(image_column, ImageFeature())

    def __len__(self) -> int:
        return len(self.dataset)

    def name(self, i: int) -> str:
        return f"{self.label}[{i}]"

    def raw(self, i: int) -> tuple[bytes, str] | None:
        """(the stored bytes, their extension) of image `i` (for `mae shard`); None when the column holds
        decoded arrays rather than encoded files."""
        if getattr(self, "_raw", None) is None:
            from datasets import Image as ImageFeature

            self._raw = self.dataset.cast_column(self.column, ImageFeature(decode=False))
        value = self._raw[int(i)][self.column]
        if not isinstance(value, dict) or not (value.get("bytes") or value.get("path")):
            return None
        data = value.get("bytes") or Path(value["path"]).read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            fmt = (img.format or "png").lower()
        return data, {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt)

    def load_array(self, i: int) -> np.ndarray:
        value = self.dataset[int(i)][self.column]
        if isinstance(value, dict):  # undecoded {"bytes", "path"}
            value = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
        return image_array(value if isinstance(value, np.ndarray) else pil_array(value), self.name(i))

    def load(self, i: int) -> Image.Image:
        value = self.dataset[int(i)][self.column]
        if isinstance(value, dict):  # undecoded {"bytes", "path"}
            value = Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
        elif isinstance(value, np.ndarray):
            value = Image.fromarray(value)
        return to_rgb(value)


class DemoSource:
    """scikit-image's bundled photos, each repeated `DEMO_REPEATS` times per epoch."""

    def __init__(self) -> None:
        import skimage.data

        self.images: list[tuple[str, Image.Image]] = []
        for name in DEMO_IMAGES:
            try:
                a = np.asarray(getattr(skimage.data, name)())
            except Exception:  # noqa: BLE001 - an image the installed version lacks is simply left out
                continue
            self.images.append((name, to_rgb(Image.fromarray(a))))
        if not self.images:
            raise DataError("the demo images of scikit-image could not be loaded; pass --data.path")

    def __len__(self) -> int:
        return len(self.images) * DEMO_REPEATS

    def name(self, i: int) -> str:
        return f"skimage.data.{self.images[i % len(self.images)][0]}"

    def load(self, i: int) -> Image.Image:
        return self.images[i % len(self.images)][1].copy()

    def load_array(self, i: int) -> np.ndarray:
        return image_array(np.asarray(self.images[i % len(self.images)][1]), self.name(i))


def load_hf_dataset(path: str, option: str = "--data.path"):
    """The `datasets.Dataset` behind `hf:NAME[:split]` or a `save_to_disk` folder; None for other paths."""
    import datasets

    if path.startswith("hf:"):
        name, _, split = path[3:].partition(":")
        try:
            return datasets.load_dataset(name, split=split or "train")
        except Exception as e:  # noqa: BLE001 - hub and builder errors vary; the message is what matters
            raise DataError(f"{option} {path}: could not load the dataset ({type(e).__name__}: {e})") from None
    p = Path(path)
    if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train" if "train" in ds else next(iter(ds))]
        return ds
    return None


def open_source(path: str | None, image_column: str | None = None):
    """The source behind `--data.path`: the one place that tells the kinds apart."""
    if path is None:
        return DemoSource()
    from mae.data.shards import is_shard_set, open_shards

    if is_shard_set(path):
        return open_shards(path)
    if not path.startswith("hf:"):
        p = Path(path)
        if not p.exists():
            raise DataError(f"--data.path {path}: no such file or folder")
        if not p.is_dir():
            raise DataError(f"--data.path {path}: expected a folder of images or a saved `datasets` folder")
    ds = load_hf_dataset(path)
    return HFSource(ds, image_column, path) if ds is not None else FolderSource(path)
