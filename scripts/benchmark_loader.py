"""Data-pipeline throughput per core: the pretraining input (decode + random-resized crop + flip + mask +
collate, as `mae pretrain` builds it) from a folder of full-size JPEGs, from shards `mae shard` made of
that folder, and from pre-resized shards (`mae shard --max_size`), measured side by side; then a folder
of many small JPEGs (where opening files, not decoding, is the cost) beside its shards; then a set of
28-px grayscale PNGs read as one channel (the Fashion-MNIST recipe's input), decoded every epoch against
kept decoded from the second epoch on (`DecodedImages`).

    python scripts/benchmark_loader.py                  # 48 generated 12 MP JPEGs (4032 x 3024)
    python scripts/benchmark_loader.py --folder DIR     # your own images
    python scripts/benchmark_loader.py --max_size 512 --rounds 5 --small 4000

Each variant is read in the training process (no workers: images/s of one core); the variants take
turns, round after round, so machine noise hits all alike, and the median round is reported. The
projection multiplies by 16 cores (a 16-core GPU host) and compares with a target, not a measurement: 4,000
images/s for a ViT-B/16 pretraining step on one H200 (scripts/gpu_benchmark.sh measures the step on a GPU).
The last line reads `shards/folder=... resized/folder=... small_shards/small_folder=...`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mae.data.demo import DEMO_IMAGES
from mae.data.open import open_source
from mae.data.samplers import EpochSampler
from mae.data.shard_writer import write_shards
from mae.data.transforms import DecodedImages, PretrainSamples, collate_samples
from mae.train.loaders import make_loader

GPU_STEP = 4000  # a target, not a measurement: images/s a ViT-B/16 MAE step should take on one H200 (bf16)
HOST_CORES = 16


def make_jpegs(folder: Path, n: int, size: tuple[int, int] = (4032, 3024)) -> None:
    """Full-size (12 MP, phone-camera) JPEGs from scikit-image's photos, upscaled, with sensor-like noise
    (upscaled photos alone compress far better than real ones)."""
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    photos = []
    for name in DEMO_IMAGES[:8]:
        a = np.asarray(Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB").resize(size))
        photos.append(a)
    for i in range(n):
        noisy = photos[i % len(photos)].astype(np.int16) + rng.integers(-6, 7, (size[1], size[0], 1), dtype=np.int16)
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"{i:04d}.jpg", quality=90)


def make_small_jpegs(folder: Path, n: int, size: tuple[int, int] = (256, 192)) -> None:
    """Many small JPEGs (web-crawl thumbnails), nested in folders of 1,000 like a real corpus."""
    rng = np.random.default_rng(1)
    for i in range(n):
        sub = folder / f"{i // 1000:03d}"
        sub.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize(size, Image.BICUBIC).save(sub / f"{i:06d}.jpg", quality=90)


def rate(path: str, batch: int) -> float:
    """Images/s of one pass over `path` through the pretraining pipeline, in this process (one core)."""
    source = open_source(path)
    samples = PretrainSamples(source, img_size=(224, 224), patch_size=16, seed=0)
    sampler = EpochSampler(len(samples), 0, shard_ends=getattr(source, "shard_ends", None))
    loader = make_loader(samples, batch_size=batch, sampler=sampler, collate_fn=collate_samples, num_workers=0)
    start, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["image"])
    return n / (time.perf_counter() - start)


def make_tiny_pngs(folder: Path, n: int) -> None:
    """28-px grayscale PNGs, like Fashion-MNIST's."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2)
    for i in range(n):
        coarse = rng.integers(0, 255, (4, 4), dtype=np.uint8)
        Image.fromarray(coarse).resize((28, 28), Image.BICUBIC).save(folder / f"{i:06d}.png")


def tiny_rate(path: str, batch: int, keep: bool) -> float:
    """Images/s of the second pass over 28-px grayscale PNGs read as one channel (patch 4), with the decoded
    images kept from the first pass (`keep`) or decoded again."""
    samples = PretrainSamples(open_source(path), img_size=(28, 28), patch_size=4, seed=0, in_chans=1)
    if not keep:
        samples.load = DecodedImages(samples.source, 1, budget=0)
    sampler = EpochSampler(len(samples), 0)
    loader = make_loader(samples, batch_size=batch, sampler=sampler, collate_fn=collate_samples, num_workers=0)
    for _ in loader:  # the first pass: decodes (and keeps, if it may)
        pass
    sampler.set_epoch(1)
    start, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["image"])
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="a folder of images (default: generated 12 MP JPEGs)")
    parser.add_argument("--images", type=int, default=48, help="how many JPEGs to generate")
    parser.add_argument("--max_size", type=int, default=768, help="mae shard --max_size of the resized shards")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", type=int, default=3000, help="how many small JPEGs (0: leave this part out)")
    parser.add_argument("--tiny", type=int, default=6000, help="how many 28-px PNGs (0: leave this part out)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "jpegs"
        if args.folder is None:
            make_jpegs(folder, args.images)
        source = open_source(str(folder))
        t = time.perf_counter()
        write_shards(source, Path(tmp) / "shards", samples_per_shard=16, progress=False)
        t_shard = time.perf_counter() - t
        t = time.perf_counter()
        write_shards(source, Path(tmp) / "resized", samples_per_shard=16, max_size=args.max_size, progress=False)
        t_resize = time.perf_counter() - t
        variants = {
            "folder": str(folder),
            "shards": str(Path(tmp) / "shards"),
            "resized": str(Path(tmp) / "resized"),
        }
        if args.small:
            make_small_jpegs(Path(tmp) / "small", args.small)
            write_shards(open_source(str(Path(tmp) / "small")), Path(tmp) / "small_shards", progress=False)
            variants.update(small_folder=str(Path(tmp) / "small"), small_shards=str(Path(tmp) / "small_shards"))
        if args.tiny:
            make_tiny_pngs(Path(tmp) / "tiny", args.tiny)
            variants.update(tiny_decoded=str(Path(tmp) / "tiny"), tiny_kept=str(Path(tmp) / "tiny"))
        sizes = {k: sum(f.stat().st_size for f in Path(v).rglob("*") if f.is_file()) for k, v in variants.items()}
        rates: dict[str, list[float]] = {k: [] for k in variants}
        rate(variants["folder"], args.batch)  # page cache and imports warm for every variant alike
        for _ in range(args.rounds):
            for k, v in variants.items():
                tiny = k.startswith("tiny_")
                rates[k].append(tiny_rate(v, 128, k == "tiny_kept") if tiny else rate(v, args.batch))
    med = {k: statistics.median(v) for k, v in rates.items()}
    what = f"{len(source)} images from {'generated 12 MP JPEGs' if args.folder is None else folder}"
    print(f"{what}; 224-px crops, batch {args.batch}, one core, median of {args.rounds} rounds")
    if args.tiny:
        print(f"tiny: {args.tiny} 28-px grayscale PNGs as one channel, batch 128, the second pass")
    print(f"mae shard: {t_shard:.1f} s; mae shard --max_size {args.max_size}: {t_resize:.1f} s")
    print(f"{'':14}{'MiB':>8}{'img/s/core':>12}{f'x{HOST_CORES} cores':>12}{'of H200 ViT-B':>15}")
    for k in variants:
        host = med[k] * HOST_CORES
        print(f"{k:14}{sizes[k] / 2**20:8.1f}{med[k]:12.1f}{host:12.0f}{host / GPU_STEP:14.0%}")
    cpu = os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip()
    print(f"cpu: {cpu}; against a target (not measured) of {GPU_STEP} images/s for a ViT-B/16 step on one H200")
    line = f"shards/folder={med['shards'] / med['folder']:.2f} resized/folder={med['resized'] / med['folder']:.2f}"
    if args.small:
        line += f" small_shards/small_folder={med['small_shards'] / med['small_folder']:.2f}"
    if args.tiny:
        line += f" tiny_kept/tiny_decoded={med['tiny_kept'] / med['tiny_decoded']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
