"""Folders of image files: unlabeled (every image below the folder, any nesting) or labeled (one subfolder
per class). Listed with `os.scandir`: no copies, no decoding."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from mae.data.base import BaseSource
from mae.data.images import IMAGE_EXTENSIONS, iter_image_files, read_array, read_rgb
from mae.errors import DataError


class FolderSource(BaseSource):
    """Every image below a folder, in sorted path order (labels, if any, are ignored)."""

    def __init__(self, root: str | os.PathLike, paths: list[str] | None = None, option: str = "--data.path") -> None:
        self.root = Path(root)
        # A NumPy string array keeps 1M paths compact and cheap to send to worker processes.
        self.paths = np.array(sorted(iter_image_files(self.root)) if paths is None else paths)
        if len(self.paths) == 0:
            exts = ", ".join(sorted(IMAGE_EXTENSIONS))
            raise DataError(f"{option} {self.root}: no images found (looked recursively for {exts})")

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return str(self.paths[i])

    def load_array(self, i: int) -> np.ndarray:
        return read_array(str(self.paths[i]))

    def raw(self, i: int) -> tuple[bytes, str]:
        """(the file's bytes, its extension) (for `mae shard`)."""
        path = str(self.paths[i])
        return Path(path).read_bytes(), os.path.splitext(path)[1].lower().lstrip(".")

    def load(self, i: int) -> Image.Image:
        return read_rgb(str(self.paths[i]), decode_side=self.decode_side)


class LabeledFolder(FolderSource):
    """`root/<class>/**/<image>`: one subfolder per class, sorted by name."""

    def __init__(self, root: str | os.PathLike, option: str = "--data.path") -> None:
        root = Path(root)
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if len(classes) < 2:
            raise DataError(
                f"{option} {root}: a labeled folder needs one subfolder per class, and at least two classes "
                f"(found {len(classes)})"
            )
        _check_class_layout(root, classes, option)
        paths, labels = [], []
        for label, name in enumerate(classes):
            files = sorted(iter_image_files(root / name))
            if not files:
                raise DataError(f"{option} {root}: class folder '{name}' has no images; remove it or add some")
            paths += files
            labels += [label] * len(files)
        super().__init__(root, paths, option)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = classes


def _images_in(folder: Path) -> list[str]:
    """Names of the image files directly in `folder` (as `iter_image_files` counts them: links not followed)."""
    return [
        e.name
        for e in os.scandir(folder)
        if not e.is_dir(follow_symlinks=False) and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS
    ]


def _check_class_layout(root: Path, classes: list[str], option: str) -> None:
    """Refuse folders whose subfolders are evidently not classes, rather than train on made-up labels."""
    loose = _images_in(root)
    if loose:
        raise DataError(
            f"{option} {root}: {len(loose)} images (e.g. {loose[0]}) sit directly in the folder, outside any class "
            "subfolder; a labeled folder holds one subfolder per class with that class's images (unlabeled images "
            "are for mae pretrain)"
        )
    if any(_images_in(root / c) for c in classes):
        return
    inner = [frozenset(e.name for e in os.scandir(root / c) if e.is_dir()) for c in classes]
    if inner[0] and all(names == inner[0] for names in inner):
        raise DataError(
            f"{option} {root}: this looks like an unlabeled nested folder, not class folders: every subfolder "
            f"({', '.join(classes[:4])}{', ...' if len(classes) > 4 else ''}) holds the same subfolders "
            f"({', '.join(sorted(inner[0])[:4])}) and no images of its own; give each class its own subfolder"
        )


def open_folder(path: str, *, labeled: bool, option: str = "--data.path") -> FolderSource:
    """A folder of images, labeled by its class subfolders when asked; the errors name `option`."""
    p = Path(path)
    if labeled:
        if not p.is_dir():
            raise DataError(f"{option} {path}: no such folder (expected class subfolders or a saved `datasets` folder)")
        return LabeledFolder(p, option)
    if not p.exists():
        raise DataError(f"{option} {path}: no such file or folder")
    if not p.is_dir():
        raise DataError(f"{option} {path}: expected a folder of images or a saved `datasets` folder")
    return FolderSource(p, option=option)
