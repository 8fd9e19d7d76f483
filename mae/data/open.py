"""The one factory: `open_source` turns a path option (`--data.path`, `--data.val_path`, ...) into an image source,
labeled or not, map-style or streaming, in the manner of timm's `create_reader`; the rest of the house never
asks which kind it got.

A source kind is a small class registered here. Each path is offered to the registered kinds, the latest
registration first, and the first whose `matches(path)` is true opens it:

    from mae.data.open import SourceKind, register_source

    @register_source
    class ZipKind(SourceKind):
        name = "zip"  # in messages and `list_sources()`

        def matches(self, path) -> bool:
            return isinstance(path, str) and path.endswith(".zip")

        def open(self, path, *, labeled, image_column, label_column, option):
            return ZipSource(path, labeled=labeled)  # an `ImageSource`; a `LabeledSource` when labeled

`open` gets `labeled` as True or False (`open_source` resolves None) and raises `DataError` naming `option`
where it cannot give what was asked; `image_column` and `label_column` are for kinds with columns. A kind
that can stream overrides `stream` (same arguments; by default a one-line refusal). A source subclasses
`mae.data.base.BaseSource` to get the protocol's defaults. Built in, in the order they are asked: a
`datasets.Dataset` object (`recorded_path` names it in records), the demo photos (no path), shard sets,
`datasets` (`hf:NAME[:split]` and `save_to_disk` folders), and folders of images (the fallback).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol, runtime_checkable

import numpy as np
from PIL import Image

from mae.data.demo import DemoSource
from mae.data.folder import open_folder
from mae.data.hf import DATASET_LABEL, is_saved_dataset, load_hf_dataset, open_hf
from mae.data.shards import is_shard_set, open_shards
from mae.data.streaming import StreamSource, not_streamable
from mae.errors import DataError
from mae.registry import Registry


@runtime_checkable
class ImageSource(Protocol):
    """A map-style source of images (`mae.data.base.BaseSource` gives the defaults of the last three)."""

    def __len__(self) -> int: ...

    def load(self, i: int) -> Image.Image:
        """Image `i` as PIL RGB (any mode converted, 8 bits)."""

    def load_array(self, i: int) -> np.ndarray:
        """Image `i` as float32 [H, W, C] at its stored precision and channel count."""

    def name(self, i: int) -> str:
        """Image `i`'s name in messages (a file path, "shard.tar:KEY", "hf:NAME[i]")."""

    def raw(self, i: int) -> tuple[bytes, str] | None:
        """(stored bytes, extension) for `mae shard` to copy, or None to have the decoded image stored."""

    def set_decode_size(self, side: int | None) -> None:
        """Images may decode at a reduced scale down to this short side (JPEG DCT scaling), or not at all."""

    shard_ends: np.ndarray | None  # cumulative sample counts of a shard set (the sampler's windows), or None


@runtime_checkable
class LabeledSource(ImageSource, Protocol):
    """An image source whose images carry classes."""

    labels: np.ndarray  # int64 [N], index into `classes`
    classes: list[str]


class SourceKind:
    """A kind of data source: a `name`, which paths it `matches`, and how it `open`s (and `stream`s) one."""

    name: str = ""

    def matches(self, path: Any) -> bool:
        raise NotImplementedError

    def open(
        self, path: Any, *, labeled: bool, image_column: str | None, label_column: str | None, option: str
    ) -> ImageSource:
        raise NotImplementedError

    def stream(
        self, path: Any, *, labeled: bool, image_column: str | None, label_column: str | None, option: str
    ) -> StreamSource:
        raise not_streamable(path)


_KINDS: Registry[SourceKind] = Registry("source kind")


def register_source(kind: type[SourceKind]) -> type[SourceKind]:
    """Register a source kind (a `SourceKind` subclass; usable as a class decorator). It is asked before
    every kind registered earlier, and replaces a kind of the same name."""
    if not kind.name:
        raise ValueError(f"{kind.__name__}: a source kind needs a name")
    _KINDS.register(kind.name, kind())
    return kind


def unregister_source(name: str) -> None:
    """Forget the kind called `name` (tests register kinds of their own and remove them after)."""
    _KINDS.unregister(name)


def _asked() -> list[SourceKind]:
    """The registered kinds in the order a path is offered to them: the latest registration first."""
    return _KINDS.values()[::-1]


def list_sources() -> list[str]:
    """The names of the registered source kinds, in the order a path is offered to them."""
    return [k.name for k in _asked()]


def open_source(
    path: str | os.PathLike | Any | None,
    *,
    labeled: bool | None = False,
    streaming: bool = False,
    image_column: str | None = None,
    label_column: str | None = None,
    option: str = "--data.path",
) -> ImageSource | StreamSource:
    """The source behind `path` (None: the demo photos, unlabeled only). `labeled`: True gives a
    `LabeledSource` or raises `DataError` naming `option`; None gives one where the source can be labeled,
    else an unlabeled one. `streaming`: a `StreamSource` for `hf:` paths, a one-line `DataError` for others."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    kind = next((k for k in _asked() if k.matches(path)), None)
    if kind is None:
        raise DataError(f"{option} {path!r}: no source kind reads this (kinds: {', '.join(list_sources())})")
    read = kind.stream if streaming else kind.open
    columns = {"image_column": image_column, "label_column": label_column, "option": option}
    if labeled is None:
        try:
            return read(path, labeled=True, **columns)
        except DataError:  # not labeled: read it without labels
            labeled = False
    return read(path, labeled=labeled, **columns)


@register_source
class FolderKind(SourceKind):
    """Any other path: a folder of images (`mae.data.folder`), labeled by its class subfolders."""

    name = "folder"

    def matches(self, path: Any) -> bool:
        return isinstance(path, str)

    def open(self, path, *, labeled, image_column, label_column, option):
        return open_folder(path, labeled=labeled, option=option)


@register_source
class HFKind(SourceKind):
    """`hf:NAME[:split]` and `save_to_disk` folders (`mae.data.hf`); `hf:` paths also stream."""

    name = "hf"

    def matches(self, path: Any) -> bool:
        return isinstance(path, str) and (path.startswith("hf:") or is_saved_dataset(path))

    def open(self, path, *, labeled, image_column, label_column, option):
        return open_hf(path, labeled=labeled, image_column=image_column, label_column=label_column, option=option)

    def stream(self, path, *, labeled, image_column, label_column, option):
        return StreamSource(path, labeled=labeled, image_column=image_column, label_column=label_column, option=option)


@register_source
class ShardKind(SourceKind):
    """WebDataset shard sets (`mae.data.shards`): a folder with `index.json`, the index, a brace pattern, URLs."""

    name = "shards"

    def matches(self, path: Any) -> bool:
        return isinstance(path, str) and is_shard_set(path)

    def open(self, path, *, labeled, image_column, label_column, option):
        return open_shards(path, labeled=labeled, option=option)


@register_source
class DemoKind(SourceKind):
    """No path: the demo photos of scikit-image (`mae.data.demo`), which have no labels."""

    name = "demo"

    def matches(self, path: Any) -> bool:
        return path is None

    def open(self, path, *, labeled, image_column, label_column, option):
        if labeled:
            raise DataError(
                f"{option}: not given, and the demo photos have no labels; give class folders, a labeled "
                "`datasets` dataset or labeled shards"
            )
        return DemoSource()


STAND_IN = "datasets.Dataset("  # how a record (config.yaml, a checkpoint's config) names a dataset object


def is_dataset_object(value: Any) -> bool:
    """A `datasets.Dataset` object (the Python API takes one wherever a data path goes)."""
    datasets = sys.modules.get("datasets")  # whoever holds a Dataset has imported datasets
    return datasets is not None and isinstance(value, datasets.Dataset)


def is_dataset(path: Any) -> bool:
    """A `datasets` dataset by any name: the object, `hf:NAME[:split]`, a `save_to_disk` folder, or the object's
    stand-in in a record."""
    if is_dataset_object(path):
        return True
    return isinstance(path, str) and (path.startswith(("hf:", STAND_IN)) or is_saved_dataset(path))


def stand_in_error(path: str, option: str) -> DataError:
    """The refusal of a dataset object's stand-in (a record names the object; the object is gone)."""
    return DataError(
        f"{option} {path}: a datasets.Dataset handed to the Python API is recorded by its fingerprint only; "
        "hand the object again, or save it (Dataset.save_to_disk) and give its folder"
    )


def dataset_named(path: Any, option: str) -> Any:
    """The `datasets.Dataset` that `path` names (`is_dataset(path)`): the object itself, or loaded from
    `hf:NAME[:split]` or a `save_to_disk` folder; the object's stand-in in a record is refused."""
    if isinstance(path, str) and path.startswith(STAND_IN):
        raise stand_in_error(path, option)
    return path if is_dataset_object(path) else load_hf_dataset(path, option)


def recorded_path(value: Any) -> Any:
    """A data path as records and messages give it: a `datasets.Dataset` object as its readable stand-in,
    `datasets.Dataset(fingerprint=..., num_rows=...)`, which a resumed run compares; anything else as it is."""
    if not is_dataset_object(value):
        return value
    return f"{STAND_IN}fingerprint={getattr(value, '_fingerprint', None)}, num_rows={value.num_rows})"


@register_source
class DatasetKind(SourceKind):
    """A `datasets.Dataset` object (the Python API), read as `hf:` datasets are; its stand-in in a record is
    refused with what to do."""

    name = DATASET_LABEL

    def matches(self, path: Any) -> bool:
        return is_dataset_object(path) or (isinstance(path, str) and path.startswith(STAND_IN))

    def open(self, path, *, labeled, image_column, label_column, option):
        if isinstance(path, str):
            raise stand_in_error(path, option)
        return open_hf(path, labeled=labeled, image_column=image_column, label_column=label_column, option=option)
