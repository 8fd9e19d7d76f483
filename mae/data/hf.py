"""Hugging Face `datasets` as sources: `hf:NAME[:split]` (through `datasets.load_dataset`), a `save_to_disk`
folder, or a `datasets.Dataset` object, read through an image column (images, arrays or file paths) and,
labeled, a label column (ClassLabel, integers or class names). The streaming variant
(`mae.data.streaming`) shares the path parser and the column detection here."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mae.data.base import BaseSource
from mae.data.images import image_array, pil_array, to_rgb
from mae.errors import DataError

DATASET_LABEL = "<datasets.Dataset>"  # how a dataset passed as an object is named in messages


def parse_hf_path(path: str) -> tuple[str, str]:
    """`hf:NAME[:split]` -> (NAME, split); the split is "train" when not given."""
    name, _, split = path.removeprefix("hf:").partition(":")
    return name, split or "train"


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a folder `datasets.Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) wrote."""
    p = Path(path)
    return (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()


def load_hf_dataset(path: str, option: str = "--data.path"):
    """The `datasets.Dataset` behind `hf:NAME[:split]` or a `save_to_disk` folder (its "train" split, or its
    first, when it holds several)."""
    import datasets

    if path.startswith("hf:"):
        name, split = parse_hf_path(path)
        try:
            return datasets.load_dataset(name, split=split)
        except Exception as e:  # noqa: BLE001 - hub and builder errors vary; the message is what matters
            raise DataError(f"{option} {path}: could not load the dataset ({type(e).__name__}: {e})") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train" if "train" in ds else next(iter(ds))]
    return ds


def is_text(feature) -> bool:
    """Whether a `datasets` column holds text: image file paths in an image column (cast to datasets' `Image`
    feature), class names in a label column (cast to a `ClassLabel`)."""
    from datasets import Value

    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def find_image_column(features, column: str | None, label: str) -> str:
    """`column` when given (it must exist), else the first column of datasets' `Image` feature."""
    from datasets import Image as ImageFeature

    if column is None:
        found = [c for c, f in features.items() if isinstance(f, ImageFeature)]
        if not found:
            raise DataError(f"{label}: no image column (columns: {list(features)}); set --data.image_column")
        return found[0]
    if column not in features:
        raise DataError(f"--data.image_column {column}: not in {label} (columns: {list(features)})")
    return column


def find_label_column(features, column: str | None, label: str) -> str:
    """`column` when given (it must exist), else the first `ClassLabel` column, else one named "label"."""
    from datasets import ClassLabel

    if column is None:
        found = [c for c, f in features.items() if isinstance(f, ClassLabel)]
        column = found[0] if found else ("label" if "label" in features else None)
    if column is None or column not in features:
        raise DataError(f"{label}: no label column (columns: {list(features)}); set --data.label_column")
    return column


def _opened(value: Any) -> Image.Image | np.ndarray:
    """A `datasets` image value as PIL or array: decoded images and arrays as they are, undecoded
    {"bytes", "path"} opened."""
    if isinstance(value, dict):
        return Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
    return value


def value_rgb(value: Any) -> Image.Image:
    """A `datasets` image value (PIL image, undecoded {"bytes", "path"}, or array) as a PIL RGB image."""
    value = _opened(value)
    return to_rgb(Image.fromarray(value) if isinstance(value, np.ndarray) else value)


def value_array(value: Any, name: str) -> np.ndarray:
    """A `datasets` image value as [H, W, C] float32 at its stored precision (`image_array`)."""
    value = _opened(value)
    return image_array(value if isinstance(value, np.ndarray) else pil_array(value), name)


class HFSource(BaseSource):
    """A `datasets.Dataset`, read through its image column (images, arrays, or file paths)."""

    def __init__(self, dataset, image_column: str | None, label: str) -> None:
        from datasets import Image as ImageFeature

        self.label = label
        self.column = find_image_column(dataset.features, image_column, label)
        self.dataset = dataset.select_columns([self.column])
        if is_text(dataset.features[self.column]):
            self.dataset = self.dataset.cast_column(self.column, ImageFeature())
        self._raw = None  # the column undecoded, made on the first `raw`

    def __len__(self) -> int:
        return len(self.dataset)

    def name(self, i: int) -> str:
        return f"{self.label}[{i}]"

    def raw(self, i: int) -> tuple[bytes, str] | None:
        """(the stored bytes, their extension) of image `i` (for `mae shard`); None when the column holds
        decoded arrays rather than encoded files."""
        if self._raw is None:
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
        return value_array(self.dataset[int(i)][self.column], self.name(i))

    def load(self, i: int) -> Image.Image:
        return value_rgb(self.dataset[int(i)][self.column])


class LabeledHF(HFSource):
    """A `datasets.Dataset` with an image column and a label column: ClassLabel, integers, or class names."""

    def __init__(self, dataset, image_column: str | None, label_column: str | None, label: str) -> None:
        from datasets import ClassLabel

        label_column = find_label_column(dataset.features, label_column, label)
        if is_text(dataset.features[label_column]):  # class names: classes in name order, as class folders are
            dataset = dataset.class_encode_column(label_column)
        labels = np.asarray(dataset[label_column], dtype=np.int64)
        feature = dataset.features[label_column]
        if isinstance(feature, ClassLabel):
            classes = list(feature.names)
        else:
            classes = [str(i) for i in range(int(labels.max()) + 1)] if len(labels) else []
        bad = np.flatnonzero((labels < 0) | (labels >= len(classes)))
        if len(bad):
            raise DataError(
                f"{label}: label {labels[bad[0]]} of row {bad[0]} is outside [0, {len(classes)}) "
                f"({len(bad)} such rows); fix the '{label_column}' column"
            )
        super().__init__(dataset, image_column, label)
        self.labels, self.classes = labels, classes


def open_hf(
    dataset, *, labeled: bool, image_column: str | None, label_column: str | None, option: str = "--data.path"
) -> HFSource:
    """`dataset`: an `hf:` path, a `save_to_disk` folder, or a `datasets.Dataset`; labeled when asked."""
    label = dataset if isinstance(dataset, str) else DATASET_LABEL
    if isinstance(dataset, str):
        dataset = load_hf_dataset(dataset, option)
    if labeled:
        return LabeledHF(dataset, image_column, label_column, label)
    return HFSource(dataset, image_column, label)
