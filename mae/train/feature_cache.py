"""Frozen features kept on disk (`mae linprobe --cache_dir`), with a record of what made them.

Each split's features and labels are `.npy` files, read back memory-mapped; `cache.json` beside them records the
encoder (a digest of its weights, its architecture, the precision it ran in), the data (per split: its path, sample
count and a fingerprint) and the transform (input size, crop, normalisation, pooling). A run reads the features
only where its own record equals the stored one; otherwise it computes them again, overwrites the files and says in
one line which part differed. The record is written last, so an interrupted write leaves a cache that is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECORD = "cache.json"
# The record's parts, as its one line names them when they differ.
PARTS = {"encoder": "by another encoder", "data": "from other data", "transform": "with another transform"}


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 of a state dict (names, dtypes, shapes and bytes, in name order): the same weights give the same digest
    whatever file, format or folder they were read from, and a random-init encoder's depends on its seed."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def data_fingerprint(source: Any) -> dict[str, Any]:
    """What identifies a labeled source's samples without reading an image: their count, the classes, the labels in
    order, and what the source and those it wraps hold in memory: the rows of a split, a folder's file names, a shard
    set's files, a `datasets` fingerprint. (File contents and times are not read: a file rewritten under the same
    name is not seen.)"""
    h = hashlib.sha256()
    classes = list(getattr(source, "classes", None) or [])
    h.update(json.dumps(classes).encode())
    labels = getattr(source, "labels", None)
    if labels is not None:
        h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    node = source
    while node is not None:
        h.update(type(node).__name__.encode())
        if getattr(node, "indices", None) is not None:  # a split: which rows of the source under it
            h.update(np.ascontiguousarray(node.indices, dtype=np.int64).tobytes())
        for listed in ("paths", "urls"):  # a folder's files, a shard set's tar files
            if getattr(node, listed, None) is not None:
                h.update("\n".join(map(str, getattr(node, listed))).encode())
        for named in ("label", "length"):  # a `datasets` source's or a stream's name, a stream's size
            if getattr(node, named, None) is not None:
                h.update(str(getattr(node, named)).encode())
        fingerprint = getattr(getattr(node, "dataset", None), "_fingerprint", None)
        if fingerprint:
            h.update(str(fingerprint).encode())
        inner = getattr(node, "source", None)  # what a split wraps, or the stream a stream's first examples come from
        node = inner if inner is not None else getattr(node, "stream", None)
    return {"samples": len(source), "classes": len(classes), "fingerprint": h.hexdigest()}


class FeatureCache:
    """A folder of cached features: `decide` (every process, before anything is written) whether they can be read,
    `read` or `write` each split, then `seal` (the record, last). Only the main process writes."""

    def __init__(self, folder: str | os.PathLike, record: dict[str, Any], option: str = "--cache_dir") -> None:
        self.folder, self.option = Path(folder), option
        self.record = json.loads(json.dumps(record))  # as it reads back from disk (tuples become lists)
        self.reusable = False

    def files(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}_features.npy", self.folder / f"{name}_labels.npy"

    def decide(self, splits: tuple[str, ...], say: Callable[[str], None]) -> bool:
        """Whether the features on disk were made as this run would make them; `say` gets one line either way when
        the folder holds features (none when it holds nothing yet)."""
        present = [p for name in splits for p in self.files(name) if p.is_file()]
        stored = self._stored()
        if not present and stored is None:
            return False
        where = f"{self.option} {self.folder}"
        reason = self._mismatch(stored, splits)
        self.reusable = reason is None
        if self.reusable:
            say(f"{where}: reading the features cached there (the same encoder, data and transform)")
        else:
            say(f"{where}: computing the features again, overwriting those there: {reason}")
        return self.reusable

    def _stored(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.folder / RECORD).read_text())
        except (OSError, ValueError):
            return None

    def _mismatch(self, stored: dict[str, Any] | None, splits: tuple[str, ...]) -> str | None:
        """Why the features on disk cannot be read (the first part that differs and how), or None."""
        if stored is None:
            return f"no {RECORD} says what made them (written by an older version, or interrupted)"
        for part, how in PARTS.items():
            if stored.get(part) != self.record[part]:
                return f"they were made {how} ({_difference(stored.get(part), self.record[part])})"
        missing = [p.name for name in splits for p in self.files(name) if not p.is_file()]
        return f"{', '.join(missing)} missing" if missing else None

    def read(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, D], labels [N]) of a split; the features memory-mapped copy-on-write (writable, so torch
        does not warn of a read-only array, and never written back)."""
        features, labels = self.files(name)
        return torch.from_numpy(np.load(features, mmap_mode="c")), torch.from_numpy(np.load(labels))

    def write(self, name: str, features: torch.Tensor, labels: torch.Tensor) -> None:
        """A split's files (main process only); the record goes first, so a cache half rewritten is never read."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / RECORD).unlink(missing_ok=True)
        for path, array in zip(self.files(name), (features.numpy(), labels.numpy()), strict=True):
            _replace(path, array)

    def seal(self) -> None:
        """Write the record (main process only), once every split is written."""
        tmp = self.folder / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        os.replace(tmp, self.folder / RECORD)


def _replace(path: Path, array: np.ndarray) -> None:
    """`np.save` into a new file renamed over `path`: a process still reading the old one memory-mapped keeps it
    (truncating it in place would pull the pages from under that process)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _difference(old: Any, new: Any, prefix: str = "") -> str:
    """The first field that differs between two parts of a record, as "field OLD, this run's NEW"."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _difference(old.get(key), new.get(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    return f"{prefix or 'record'} {_short(old)}, this run's {_short(new)}"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text[:12] if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text[:80]
