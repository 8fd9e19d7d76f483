"""A `datasets.Dataset` as a segmentation source (`mae segment --data.path hf:NAME[:split]`, a `save_to_disk` folder,
or the object from Python): images from an image column, masks from a mask column (images of class indices,
palette images read as their indices, or H x W integer arrays; 255 = ignore), checked as a folder's masks are
(`MaskedSource.check_masks`). Class names come from a ClassLabel inside the mask column's feature (arrays of
ClassLabel values), else they are counted.

Without --data.mask_column the masks are the first column named like masks in the sets on the Hub
(`MASK_COLUMNS`: scene_parse_150's "annotation", the "label" of transformers' segmentation examples), else the
Image column beside the images; the images are the first other Image column unless --data.image_column says.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from mae.data.hf import HFSource, find_image_column, is_text
from mae.data.masks import MaskedSource, mask_indices
from mae.errors import DataError

MASK_COLUMNS = ("mask", "label", "annotation", "segmentation", "semantic_mask")  # tried in this order


def _element(feature: Any) -> Any:
    """The feature of a list feature's elements (`Sequence`, `List`, `LargeList`, `[feature]`), else None."""
    if isinstance(feature, list):
        return feature[0]
    return getattr(feature, "feature", None) if type(feature).__name__ in ("Sequence", "List", "LargeList") else None


def mask_like(feature: Any) -> bool:
    """Whether a column can hold masks: images, image file paths (text), or 2-D arrays (`Array2D`, lists of
    lists)."""
    from datasets import Array2D
    from datasets import Image as ImageFeature

    inner = _element(feature)
    return isinstance(feature, (ImageFeature, Array2D)) or is_text(feature) or _element(inner) is not None


def mask_class_names(feature: Any) -> list[str] | None:
    """The names of the ClassLabel a mask column's arrays hold, or None."""
    from datasets import ClassLabel

    while feature is not None and not isinstance(feature, ClassLabel):
        feature = _element(feature)
    return list(feature.names) if feature is not None else None


def image_column_to_segment(features, image_column: str | None, label: str) -> str:
    """The column of images to segment in a dataset that may hold masks too: as given, else the first Image column
    that is not a mask column by its name (so a dataset that lists its masks first is not segmented by them)."""
    masks = {c for c in MASK_COLUMNS if c in features and mask_like(features[c])}
    others = {c: f for c, f in features.items() if c not in masks}
    return find_image_column(features if image_column or not others else others, image_column, label)


def find_mask_columns(features, image_column: str | None, mask_column: str | None, label: str) -> tuple[str, str]:
    """(image column, mask column) of a dataset with `features`: each as given, else as the module says."""
    from datasets import Image as ImageFeature

    if mask_column is not None and mask_column not in features:
        raise DataError(f"--data.mask_column {mask_column}: not in {label} (columns: {list(features)})")
    if mask_column is not None and mask_column == image_column:
        raise DataError(f"--data.mask_column {mask_column}: also --data.image_column; give the column of masks")
    if mask_column is None:
        named = [c for c in MASK_COLUMNS if c in features and c != image_column and mask_like(features[c])]
        mask_column = named[0] if named else None
    others = {c: f for c, f in features.items() if c != mask_column}
    image_column = find_image_column(features if image_column else others, image_column, label)
    if mask_column is None:
        rest = [c for c, f in others.items() if c != image_column and isinstance(f, ImageFeature)]
        if not rest:
            raise DataError(f"{label}: no mask column (columns: {list(features)}); set --data.mask_column to the "
                            "column of per-pixel class masks")  # fmt: skip
        mask_column = rest[0]
    if not mask_like(features[mask_column]):
        raise DataError(f"--data.mask_column {mask_column}: holds {features[mask_column]}, not masks; give a column "
                        "of per-pixel class masks (images, or H x W arrays)")  # fmt: skip
    return image_column, mask_column


def _opened(value: Any) -> Any:
    """An undecoded `datasets` image value ({"bytes", "path"}) as a lazily read PIL image; arrays as they are."""
    if isinstance(value, dict):
        return Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
    return value


class SegmentationHF(MaskedSource):
    """A `datasets.Dataset` with an image column and a mask column (see the module). Images come through
    `HFSource` (as every `datasets` source gives them); masks and image sizes from the stored files, undecoded by
    `datasets` (so a mask is read as a folder's mask file is). `label` names the dataset in messages."""

    def __init__(self, dataset, *, image_column: str | None, mask_column: str | None, label: str,
                 num_classes: int | None = None) -> None:  # fmt: skip
        from datasets import Image as ImageFeature

        self.label = label
        image, mask = find_mask_columns(dataset.features, image_column, mask_column, label)
        self.images = HFSource(dataset, image, label)
        self.image_column, self.mask_column = image, mask
        stored = dataset.select_columns([image, mask])
        for column in (image, mask):  # files as stored: paths and images alike, read by PIL here
            if is_text(stored.features[column]) or isinstance(stored.features[column], ImageFeature):
                stored = stored.cast_column(column, ImageFeature(decode=False))
        self.stored, self.rows = stored, np.arange(len(dataset))
        names = mask_class_names(dataset.features[mask])
        self.classes = self.check_masks(names, num_classes, f"the ClassLabel of column '{mask}'")

    def __len__(self) -> int:
        return len(self.rows)

    def _value(self, i: int, column: str) -> Any:
        return self.stored[int(self.rows[i])][column]

    def load(self, i: int) -> Image.Image:
        return self.images.load(int(self.rows[i]))

    def load_array(self, i: int) -> np.ndarray:
        return self.images.load_array(int(self.rows[i]))

    def name(self, i: int) -> str:
        return f"{self.images.name(int(self.rows[i]))} column '{self.image_column}'"

    def mask_name(self, i: int) -> str:
        return f"{self.images.name(int(self.rows[i]))} column '{self.mask_column}'"

    def read_mask(self, i: int) -> tuple[np.ndarray, list[int] | None]:
        value = self._value(i, self.mask_column)
        if value is None:
            raise DataError(f"{self.mask_name(i)}: no mask (None); every row needs one: fill it, or drop the row "
                            "(Dataset.filter)")  # fmt: skip
        mask = _opened(value)
        try:
            return mask_indices(mask, self.mask_name(i))
        finally:
            if isinstance(mask, Image.Image):
                mask.close()

    def image_size(self, i: int) -> tuple[int, int]:
        value = _opened(self._value(i, self.image_column))
        if value is None:
            raise DataError(f"{self.name(i)}: no image (None); every row needs one: fill it, or drop the row "
                            "(Dataset.filter)")  # fmt: skip
        if isinstance(value, Image.Image):
            with value:
                return value.height, value.width
        shape = np.shape(value)
        return int(shape[0]), int(shape[1])

    def subset(self, rows: np.ndarray) -> SegmentationHF:
        part = object.__new__(SegmentationHF)
        part.__dict__.update(self.__dict__)
        part.rows = self.rows[np.asarray(rows)]
        return part
