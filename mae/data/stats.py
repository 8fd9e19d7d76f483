"""Per-channel statistics of a data source: what `--data.mean auto` / `--data.std auto` and `mae stats` use."""

from __future__ import annotations

import numpy as np
import torch

from mae.data.images import DECODE_ERRORS
from mae.data.transforms import load_image
from mae.errors import DataError


def stored_channels(source, *, tries: int = 100) -> int:
    """How many channels the first readable image of `source` stores (8-bit pictures: 1 for grayscale, 3 for
    colour, as `--model.in_chans` would read them)."""
    for index in range(min(tries, len(source))):
        try:
            array = source.load_array(index)
        except DECODE_ERRORS:
            continue
        return int(array.shape[-1]) if array.ndim == 3 else 1
    raise DataError(f"none of the first {min(tries, len(source))} images could be read; check --data.path")


def channel_stats(source, in_chans: int, *, samples: int = 1000, seed: int = 0) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of the pixels, in [0, 1], of a seeded sample of up to `samples` whole images
    (read as training reads them); unreadable files are left out."""
    order = np.random.default_rng(seed).permutation(len(source))[: min(samples, len(source))]
    total = np.zeros(in_chans)
    squares = np.zeros(in_chans)
    count = 0
    for index in np.sort(order):
        img, bad = load_image(source, int(index), in_chans)
        if bad is not None:
            continue
        x = img if isinstance(img, torch.Tensor) else torch.from_numpy(np.array(img)).permute(2, 0, 1) / 255.0
        x = x.double().flatten(1)  # [C, H * W], float64: sums over millions of pixels
        total += x.sum(1).numpy()
        squares += (x * x).sum(1).numpy()
        count += x.shape[1]
    if count == 0:
        raise DataError("no readable image to measure the channel statistics on")
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    return [round(float(v), 6) for v in mean], [round(max(float(v), 1e-6), 6) for v in std]
