"""WebDataset shards as a source: `mae shard` writes them (`mae.data.shard_writer`), every stage reads them.

A shard set is tar files in the WebDataset layout (`KEY.jpg` / `KEY.png` / `KEY.npy` ..., plus `KEY.cls`
when labeled) and an index, `index.json`: a `wids` dataset descriptor (`shardlist` of `url` and
`nsamples`) with this project's additions (`classes`, each shard's `labels`, the options used).

Shards are read by random access through `wids` (its memory-mapped tar index; no tar parser here), so a
shard set is an image source like a folder: the epoch sampler, per-sample seeds, Accelerate's batch
sharding and mid-epoch resume work unchanged, and the same guarantees hold (every sample once per
epoch over all processes and workers; results independent of their number; bit-identical resume).
The sampler keeps reads local: it shuffles the shard order each epoch and the samples within windows
of a few shards (`mae.data.samplers`; `mae shard` shuffles the samples when it writes them).

`--data.path` takes a folder holding `index.json`, the index itself (a path or URL), a brace pattern
(`/data/train-{000000..000127}.tar`), or the URLs `webdataset` takes (`https://`, `s3://`, `gs://`,
`pipe:CMD`); remote shards are downloaded once into `$MAE_SHARD_CACHE` (default `~/.cache/mae/shards`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from PIL import Image

from mae.data.base import BaseSource
from mae.data.images import IMAGE_EXTENSIONS, read_array, read_rgb
from mae.errors import DataError

INDEX = "index.json"
OPEN_SHARDS = 16  # open (memory-mapped) shards kept per process
IMAGE_MEMBERS = tuple(ext.lstrip(".") for ext in sorted(IMAGE_EXTENSIONS))
REMOTE_SCHEMES = ("http", "https", "s3", "gs", "ftp", "ftps")


def is_remote(url: str) -> bool:
    return url.startswith("pipe:") or urlparse(url).scheme in REMOTE_SCHEMES


def is_shard_set(path: str) -> bool:
    """Whether `--data.path` names a shard set (rather than a folder of images or a `datasets` source)."""
    if path.startswith("hf:"):
        return False
    if is_remote(path) or path.endswith((".tar", ".json")) or ("{" in path and ".tar" in path):
        return True
    return read_index(Path(path) / INDEX) is not None


def read_index(path: Path) -> dict | None:
    """The shard index at `path`, or None when there is none (or the file there is another kind of JSON)."""
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and "shardlist" in index else None


def _load_index(path: str, option: str) -> tuple[dict, str]:
    """(index, the folder or URL its shard names are relative to)."""
    if is_remote(path):
        local = _download(path, option)
        index, base = read_index(Path(local)), path.rsplit("/", 1)[0]
    else:
        p = Path(path)
        index, base = read_index(p / INDEX if p.is_dir() else p), str(p if p.is_dir() else p.parent)
    if index is None:
        raise DataError(f"{option} {path}: not a shard index (a JSON file with a 'shardlist'; mae shard writes one)")
    return index, base


def _join(base: str, url: str) -> str:
    if is_remote(url) or os.path.isabs(url):
        return url
    return f"{base}/{url}" if is_remote(base) else os.path.join(base, url)


def _cache_dir() -> Path:
    return Path(os.environ.get("MAE_SHARD_CACHE", Path.home() / ".cache" / "mae" / "shards"))


def _download(url: str, option: str) -> str:
    """A remote shard or index, downloaded once into the cache (wids' downloaders: curl, aws s3, gsutil;
    `pipe:CMD` runs CMD, which writes the file to its standard output, as in webdataset), under a
    temporary name renamed when complete: an interrupted download is never taken for a shard."""
    import subprocess

    from wids.wids_dl import download_file

    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(url.encode()).hexdigest()[:16] + "_" + os.path.basename(urlparse(url).path or "shard")
    local = folder / name
    if not local.exists():
        part = folder / f".{name}.{os.getpid()}.part"
        try:
            if url.startswith("pipe:"):
                with open(part, "wb") as f:
                    subprocess.run(url[5:], shell=True, stdout=f, check=True)
            else:
                download_file(url, str(part))
            os.replace(part, local)
        except (AssertionError, OSError, ValueError, subprocess.CalledProcessError) as e:
            part.unlink(missing_ok=True)
            raise DataError(f"{option}: could not fetch {url} ({e}); check the URL and your credentials") from None
    return str(local)


def resolve_shards(path: str, option: str = "--data.path") -> tuple[list[dict], dict]:
    """([{"url", "nsamples", "labels"?}], the index's other fields) for any form `--data.path` takes."""
    if path.endswith(".json") or not (path.endswith(".tar") or "{" in path or is_remote(path)):
        index, base = _load_index(path, option)
        shards = [dict(s, url=_join(base, s["url"])) for s in index["shardlist"]]
        return shards, index
    from webdataset.shardlists import expand_urls

    urls = expand_urls(path)  # webdataset's own: `::`-separated lists, braces, ${WDS_VAR}s
    # An index beside the shards gives their sizes (and labels) without reading them.
    local_index = None if is_remote(urls[0]) else read_index(Path(urls[0]).parent / INDEX)
    if local_index is not None:
        known = {os.path.basename(s["url"]): s for s in local_index["shardlist"]}
        if all(os.path.basename(u) in known for u in urls):
            return [dict(known[os.path.basename(u)], url=u) for u in urls], local_index
    check_readable(urls, option)
    shards = []
    for url in urls:  # no index: count (and read the labels of) each shard once
        tar = _open_tar(url, option)
        labels = [_label(tar[i]) for i in range(len(tar))]
        entry = {"url": url, "nsamples": len(tar)}
        if all(label is not None for label in labels):
            entry["labels"] = labels
        shards.append(entry)
        tar.close()
    return shards, {}


def check_readable(urls: list[str], option: str) -> None:
    """Every local shard exists, can be read and starts with a tar header (uncompressed, as wids reads them):
    checked before training starts (remote shards are checked when downloaded)."""
    for url in urls:
        if is_remote(url):
            continue
        path = urlparse(url).path if url.startswith("file:") else url
        try:
            with tarfile.open(path, "r:"):  # reads the first member's header only
                pass
        except OSError as e:
            raise DataError(
                f"{option}: shard {path} cannot be read ({e.strerror or e}); restore it, or re-create the shard "
                "set with mae shard"
            ) from None
        except tarfile.TarError:
            raise DataError(
                f"{option}: shard {path} is not a tar file; restore it, or re-create the shard set"
            ) from None


def _open_tar(url: str, option: str = "--data.path"):
    from wids.wids import IndexedTarSamples

    local = _download(url, option) if is_remote(url) else (urlparse(url).path if url.startswith("file:") else url)
    try:
        return IndexedTarSamples(path=local)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{option}: shard {url} cannot be read as a tar file ({e}); restore or re-create it") from None


def _label(sample: dict) -> int | None:
    cls = sample.get(".cls")  # wids names a sample's members by their extension, dot included
    return None if cls is None else int(cls.read().decode().strip())


def _close(_k: int, tar) -> None:
    tar.close()


def _shard_cache():
    """wids' LRU cache of open shards: the least recently read one is closed beyond `OPEN_SHARDS`."""
    from wids.wids import LRUCache

    return LRUCache(OPEN_SHARDS, release_handler=_close)


class ShardSource(BaseSource):
    """An image source over a shard set: `len`, `load(i)`, `load_array(i)`, `name(i)` ("shard.tar:KEY"),
    and `shard_ends` (cumulative sample counts: the sampler's locality windows)."""

    def __init__(self, shards: list[dict], label: str, option: str = "--data.path") -> None:
        if not shards:
            raise DataError(f"{option} {label}: the shard set lists no shards")
        self.label, self.option = label, option
        self.urls = [s["url"] for s in shards]
        self.counts = np.asarray([int(s["nsamples"]) for s in shards], dtype=np.int64)
        self.shard_ends = np.cumsum(self.counts)
        self._open = _shard_cache()  # per process (emptied when pickled to a worker)
        check_readable(self.urls, option)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": _shard_cache()}

    def __len__(self) -> int:
        return int(self.shard_ends[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.shard_ends, i, side="right"))
        return k, int(i - (self.shard_ends[k - 1] if k else 0))

    def _tar(self, k: int):
        tar = self._open[k]
        if tar is None:
            tar = _open_tar(self.urls[k], self.option)
            n = len(tar)
            if n != self.counts[k]:
                tar.close()
                raise DataError(
                    f"{self.option}: shard {self.urls[k]} holds {n} samples, but the index says "
                    f"{self.counts[k]}; re-create the shard set (mae shard) or its index"
                )
            self._open[k] = tar
        return tar

    def _member(self, i: int) -> tuple[str, io.BytesIO]:
        """(name "shard.tar:KEY.ext", bytes) of sample `i`'s image."""
        k, j = self._locate(i)
        sample = self._tar(k)[j]
        name = f"{self.urls[k]}:{sample['__key__']}"
        for ext in IMAGE_MEMBERS:
            if "." + ext in sample:  # wids names members by their extension, dot included
                return f"{name}.{ext}", sample["." + ext]
        raise OSError(f"{name}: no image member (expected one of .{', .'.join(IMAGE_MEMBERS)})")

    def raw(self, i: int) -> tuple[bytes, str]:
        """(the stored bytes, their extension) of sample `i`'s image (for `mae shard`)."""
        name, data = self._member(i)
        return data.getvalue(), name.rsplit(".", 1)[1]

    def name(self, i: int) -> str:
        k, j = self._locate(i)
        return f"{self.urls[k]}:{self._tar(k)[j]['__key__']}"

    def load(self, i: int) -> Image.Image:
        name, data = self._member(i)
        return read_rgb(name, data, self.decode_side)

    def load_array(self, i: int) -> np.ndarray:
        name, data = self._member(i)
        return read_array(name, data)


class LabeledShards(ShardSource):
    """A shard set whose samples carry `KEY.cls`: adds `labels` and `classes` (from the index)."""

    def __init__(self, shards: list[dict], classes: list[str] | None, label: str, option: str) -> None:
        missing = [s["url"] for s in shards if "labels" not in s]
        if missing:
            raise DataError(
                f"{option} {label}: shard {missing[0]} has no labels (.cls members); a labeled stage needs "
                "shards written from a labeled source (class folders, or a dataset with a label column)"
            )
        super().__init__(shards, label, option)
        self.labels = np.concatenate([np.asarray(s["labels"], dtype=np.int64) for s in shards])
        self.classes = list(classes) if classes else [str(c) for c in range(int(self.labels.max()) + 1)]
        bad = np.flatnonzero((self.labels < 0) | (self.labels >= len(self.classes)))
        if len(bad):
            raise DataError(f"{option} {label}: label {self.labels[bad[0]]} is outside the {len(self.classes)} classes")


def open_shards(path: str, *, labeled: bool = False, option: str = "--data.path") -> ShardSource:
    shards, index = resolve_shards(path, option)
    if labeled:
        return LabeledShards(shards, index.get("classes"), path, option)
    return ShardSource(shards, path, option)
