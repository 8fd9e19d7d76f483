"""WebDataset shards: `mae shard` writes them, every stage reads them.

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
import tempfile
from collections import OrderedDict
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from PIL import Image

from mae.data.sources import IMAGE_EXTENSIONS, DataError, read_array, read_rgb
from mae.run_folder import follow_umask

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
    return _read_index_file(Path(path) / INDEX) is not None


def _read_index_file(path: Path) -> dict | None:
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
        index, base = _read_index_file(Path(local)), path.rsplit("/", 1)[0]
    else:
        p = Path(path)
        index, base = _read_index_file(p / INDEX if p.is_dir() else p), str(p if p.is_dir() else p.parent)
    if index is None:
        raise DataError(f"{option} {path}: not a shard index (a JSON file with a 'shardlist'; mae shard writes one)")
    return index, base


def _join(base: str, url: str) -> str:
    if is_remote(url) or os.path.isabs(url):
        return url
    return f"{base}/{url}" if is_remote(base) else os.path.join(base, url)


def _expand(pattern: str) -> list[str]:
    import braceexpand

    return [u for part in pattern.split("::") for u in braceexpand.braceexpand(part)]


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
    urls = _expand(path)
    # An index beside the shards gives their sizes (and labels) without reading them.
    local_index = None if is_remote(urls[0]) else _read_index_file(Path(urls[0]).parent / INDEX)
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
    """Every local shard exists, can be read and starts like a tar file: checked before training starts
    (remote shards are checked when downloaded)."""
    for url in urls:
        if is_remote(url):
            continue
        path = urlparse(url).path if url.startswith("file:") else url
        try:
            with open(path, "rb") as f:
                header = f.read(512)
        except OSError as e:
            raise DataError(
                f"{option}: shard {path} cannot be read ({e.strerror or e}); restore it, or re-create the shard "
                "set with mae shard"
            ) from None
        if len(header) < 512 or header[257:262] != b"ustar":
            raise DataError(f"{option}: shard {path} is not a tar file; restore it, or re-create the shard set")


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


class ShardSource:
    """An image source over a shard set: `len`, `load(i)`, `load_array(i)`, `name(i)` ("shard.tar:KEY"),
    and `shard_ends` (cumulative sample counts: the sampler's locality windows)."""

    def __init__(self, shards: list[dict], label: str, option: str = "--data.path") -> None:
        if not shards:
            raise DataError(f"{option} {label}: the shard set lists no shards")
        self.label, self.option = label, option
        self.urls = [s["url"] for s in shards]
        self.counts = np.asarray([int(s["nsamples"]) for s in shards], dtype=np.int64)
        self.shard_ends = np.cumsum(self.counts)
        self.decode_side: int | None = None
        self._open: OrderedDict = OrderedDict()  # per process (dropped when pickled to a worker)
        check_readable(self.urls, option)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}

    def __len__(self) -> int:
        return int(self.shard_ends[-1])

    def set_decode_size(self, side: int | None) -> None:
        self.decode_side = side

    def _locate(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.shard_ends, i, side="right"))
        return k, int(i - (self.shard_ends[k - 1] if k else 0))

    def _tar(self, k: int):
        tar = self._open.pop(k, None)
        if tar is None:
            tar = _open_tar(self.urls[k], self.option)
            if len(tar) != self.counts[k]:
                raise DataError(
                    f"{self.option}: shard {self.urls[k]} holds {len(tar)} samples, but the index says "
                    f"{self.counts[k]}; re-create the shard set (mae shard) or its index"
                )
            while len(self._open) >= OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
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


def open_shards(path: str, option: str = "--data.path", labeled: bool = False) -> ShardSource:
    shards, index = resolve_shards(path, option)
    if labeled:
        return LabeledShards(shards, index.get("classes"), path, option)
    return ShardSource(shards, path, option)


# ----------------------------------------------------------------------------------------------- writing


def _raw_image(source, i: int) -> tuple[bytes, str]:
    """(the stored bytes, their extension) of image `i`, without decoding where the source allows."""
    stored = source.raw(i) if hasattr(source, "raw") else None
    if stored is not None:
        return stored
    buf = io.BytesIO()
    source.load(i).save(buf, format="PNG")
    return buf.getvalue(), "png"


def _shrink(data: bytes, ext: str, max_size: int, name: str) -> tuple[bytes, str]:
    """Re-encode an image whose longer side exceeds `max_size` (aspect kept; EXIF orientation applied):
    JPEGs as JPEG (quality 95), arrays as .npy at their dtype, everything else as PNG (lossless)."""
    if ext in ("npy", "tif", "tiff"):
        import torch
        from torchvision.transforms.v2 import functional as F

        a = np.load(io.BytesIO(data)) if ext == "npy" else None
        if a is None:
            import tifffile

            a = tifffile.imread(io.BytesIO(data))
        hw = a.shape[:2] if a.ndim == 2 or a.shape[-1] <= a.shape[0] else a.shape[1:]
        if max(hw) <= max_size:
            return data, ext
        x = read_array(f"{name}.{ext}", io.BytesIO(data))
        scale = max_size / max(x.shape[:2])
        size = [max(1, round(x.shape[0] * scale)), max(1, round(x.shape[1] * scale))]
        y = F.resize(torch.from_numpy(x).permute(2, 0, 1), size, antialias=True).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        np.save(buf, y.astype(np.float32))
        return buf.getvalue(), "npy"
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as img:
        if max(img.size) <= max_size:
            return data, ext
        jpeg = img.format == "JPEG"
        img = ImageOps.exif_transpose(img)
        scale = max_size / max(img.size)
        size = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
        if jpeg:
            img.draft(img.mode, size)  # libjpeg's DCT scaling down to at least twice the size, then a proper filter
        img = img.resize(size, Image.Resampling.LANCZOS, reducing_gap=None if jpeg else 3.0)
        buf = io.BytesIO()
        if jpeg and img.mode in ("RGB", "L", "CMYK"):
            img.save(buf, format="JPEG", quality=95)
            return buf.getvalue(), "jpg"
        img.save(buf, format="PNG")
        return buf.getvalue(), "png"


def write_shards(
    source,
    output: str | Path,
    *,
    samples_per_shard: int = 10_000,
    max_size: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    options: dict | None = None,
    progress: bool = True,
) -> Path:
    """Write `source` (an image source; labeled ones add `KEY.cls`) as WebDataset shards plus `index.json`.

    Samples go in a seeded random order (so the reader's shard-local shuffle mixes the whole set); keys
    are the samples' positions in the source. Each shard is written under a temporary name and renamed
    when complete, and the index is written last: an interrupted run leaves no shard set that looks
    complete (running again starts over). The source's files are only read."""
    import webdataset as wds
    from tqdm.auto import tqdm

    out = Path(output)
    if _read_index_file(out / INDEX) is not None:
        raise DataError(f"--output {out}: already holds a shard set ({INDEX}); choose another folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tar.partial"):
        stale.unlink()
    n = len(source)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    labels = getattr(source, "labels", None)
    width = max(6, len(str((n - 1) // samples_per_shard)))
    shards, total_bytes = [], 0
    bar = tqdm(total=n, disable=not progress, desc="shard", unit="img")
    for first in range(0, n, samples_per_shard):
        name = f"shard-{first // samples_per_shard:0{width}d}.tar"
        part = out / (name + ".partial")
        chunk = order[first : first + samples_per_shard]
        with open(part, "wb") as f:
            writer = wds.TarWriter(f)
            for i in chunk:
                data, ext = _raw_image(source, int(i))
                if max_size:
                    data, ext = _shrink(data, ext, max_size, source.name(int(i)))
                sample = {"__key__": f"{int(i):09d}", ext: data}
                if labels is not None:
                    sample["cls"] = str(int(labels[i])).encode()
                writer.write(sample)
                bar.update(1)
            writer.close()
        os.replace(part, out / name)
        entry = {"url": name, "nsamples": len(chunk), "filesize": (out / name).stat().st_size}
        if labels is not None:
            entry["labels"] = [int(labels[i]) for i in chunk]
        shards.append(entry)
        total_bytes += entry["filesize"]
    bar.close()
    index = {
        "wids_version": 1,
        "name": out.name,
        "shardlist": shards,
        "samples": n,
        "classes": list(source.classes) if labels is not None else None,
        "options": options or {},
    }
    fd, tmp = tempfile.mkstemp(prefix=".index-", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(index, f)
    os.replace(tmp, out / INDEX)
    follow_umask(out / INDEX)
    return out / INDEX


def shard_source(cfg) -> Path:
    """`mae shard`: open `cfg.source` as --data.path would (labeled when asked, or when it can be), write it."""
    from dataclasses import asdict

    from mae.data.labeled import open_labeled
    from mae.data.sources import open_source

    source = None
    if cfg.labeled is not False:
        try:
            source = open_labeled(cfg.source, cfg.image_column, cfg.label_column, option="source")
        except DataError:
            if cfg.labeled:
                raise
    if source is None:
        source = open_source(cfg.source, cfg.image_column)
    what = f"{len(source)} images" + (f" in {len(source.classes)} classes" if hasattr(source, "classes") else "")
    print(f"mae shard: {what} from {cfg.source} -> {cfg.output}", flush=True)
    options = {k: v for k, v in asdict(cfg).items() if k != "output"}
    index = write_shards(
        source,
        cfg.output,
        samples_per_shard=cfg.samples_per_shard,
        max_size=cfg.max_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        options=options,
    )
    shards = json.loads(index.read_text())["shardlist"]
    size = sum(s["filesize"] for s in shards) / 2**20
    print(f"wrote {len(shards)} shards ({size:.1f} MiB) and {index}; use --data.path {cfg.output}")
    return index
