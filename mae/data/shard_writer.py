"""Writing WebDataset shards (`mae shard`): any image source as tar files plus an index, `index.json`, that
`mae.data.shards` reads (the layout is described there)."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from mae.data.images import read_array
from mae.data.shards import INDEX, read_index
from mae.errors import DataError
from mae.run_folder import follow_umask


def _raw_image(source, i: int) -> tuple[bytes, str]:
    """(the stored bytes, their extension) of image `i`, without decoding where the source allows."""
    stored = source.raw(i)
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


def _write_shard(source, out: Path, name: str, chunk: np.ndarray, labels, max_size: int | None, bar) -> dict:
    """One tar of the samples `chunk`, written as NAME.partial and renamed when complete; its index entry."""
    import webdataset as wds

    part = out / (name + ".partial")
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
    return entry


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
    from tqdm.auto import tqdm

    out = Path(output)
    if read_index(out / INDEX) is not None:
        raise DataError(f"--output {out}: already holds a shard set ({INDEX}); choose another folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tar.partial"):
        stale.unlink()
    n = len(source)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    labels = getattr(source, "labels", None)
    width = max(6, len(str((n - 1) // samples_per_shard)))
    bar = tqdm(total=n, disable=not progress, desc="shard", unit="img")
    shards = [
        _write_shard(
            source,
            out,
            f"shard-{first // samples_per_shard:0{width}d}.tar",
            order[first : first + samples_per_shard],
            labels,
            max_size,
            bar,
        )  # fmt: skip
        for first in range(0, n, samples_per_shard)
    ]
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
