"""Image sources behind one interface: `len(source)`, `source.load(i) -> PIL RGB image`, `source.name(i)`.

- an unlabeled folder: recursive, any nesting, listed with `os.scandir` (no copies, no decoding);
- a Hugging Face `datasets` dataset: `hf:NAME[:split]` or a `save_to_disk` folder;
- no path: the demo photos that ship inside scikit-image.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"})
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


class DataError(ValueError):
    """Bad data input; the message names the path or option and says what to do."""


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

    def load(self, i: int) -> Image.Image:
        with Image.open(str(self.paths[i])) as img:
            if self.decode_side and img.format == "JPEG" and min(img.size) > self.decode_side:
                scale = self.decode_side / min(img.size)
                img.draft("RGB", (math.ceil(img.width * scale), math.ceil(img.height * scale)))
            img.load()
            return to_rgb(img)


class HFSource:
    """A `datasets.Dataset`, read through its image column."""

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

    def __len__(self) -> int:
        return len(self.dataset)

    def name(self, i: int) -> str:
        return f"{self.label}[{i}]"

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
    """The source behind `--data.path`."""
    if path is None:
        return DemoSource()
    if not path.startswith("hf:"):
        p = Path(path)
        if not p.exists():
            raise DataError(f"--data.path {path}: no such file or folder")
        if not p.is_dir():
            raise DataError(f"--data.path {path}: expected a folder of images or a saved `datasets` folder")
    ds = load_hf_dataset(path)
    return HFSource(ds, image_column, path) if ds is not None else FolderSource(path)
