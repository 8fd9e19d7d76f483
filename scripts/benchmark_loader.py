"""Data-pipeline throughput: decode + random-resized-crop + flip + collate from a folder of full-size JPEGs,
with the loader `mae pretrain` builds (its default workers), beside the training step it feeds.

    python scripts/benchmark_loader.py                # 64 full-size JPEGs made from scikit-image's photos
    python scripts/benchmark_loader.py --folder DIR   # your own images

Prints images/s of the loader and of the small preset's bf16 step (one core count for both) and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import mae
from mae.config import DataConfig
from mae.data.samplers import EpochSampler
from mae.data.sources import DEMO_IMAGES, open_source
from mae.data.transforms import PretrainSamples, collate_samples, normalize
from mae.train.run import adamw, configure_speed, make_loader


def make_jpegs(folder: Path, n: int, size: tuple[int, int] = (4032, 3024)) -> None:
    """Full-size (12 MP, phone-camera) JPEGs from scikit-image's photos, upscaled."""
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    photos = []
    for name in DEMO_IMAGES[:8]:
        a = np.asarray(getattr(skimage.data, name)())
        photos.append(Image.fromarray(a).convert("RGB").resize(size, Image.BILINEAR))
    for i in range(n):
        photos[i % len(photos)].save(folder / f"{i:04d}.jpg", quality=90)


def loader_rate(folder: Path, batch: int, workers: int, batches: int) -> float:
    source = open_source(str(folder))
    samples = PretrainSamples(source, img_size=(224, 224), patch_size=16, seed=0)
    sampler = EpochSampler(len(samples), 0)
    loader = make_loader(samples, batch_size=batch, sampler=sampler, collate_fn=collate_samples, num_workers=workers)
    it = iter(loader)
    next(it)  # workers started
    start, n = time.perf_counter(), 0
    for _ in range(batches):
        try:
            n += len(next(it)["image"])
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            it = iter(loader)
    return n / (time.perf_counter() - start)


def step_rate(batch: int, device: str, steps: int = 4) -> float:
    model = mae.create_mae("mae_vit_small_patch16").to(device)
    configure_speed(model, device, "bf16")
    opt = adamw(model, lr=1e-4, weight_decay=0.05, betas=(0.9, 0.95))
    images = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=device)
    times = []
    for _ in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(normalize(images, DataConfig().mean, DataConfig().std)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return batch / min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="a folder of images (default: generated 12 MP JPEGs)")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=DataConfig().num_workers)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "jpegs"
        if args.folder is None:
            make_jpegs(folder, args.images)
        rate = loader_rate(folder, args.batch, args.workers, batches=args.images // args.batch * 2)
    step = step_rate(args.batch, args.device)
    print(
        f"loader ({args.workers} workers, 224 px crops from {'12 MP JPEGs' if args.folder is None else folder}): "
        f"{rate:.1f} images/s"
    )
    print(f"training step (small preset, bf16, batch {args.batch}, {args.device}): {step:.1f} images/s")
    print(f"loader/step={rate / step:.2f}")


if __name__ == "__main__":
    main()
