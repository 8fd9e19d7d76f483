"""Synthetic textures for the anomaly tests: stripes one way are normal, stripes the other way, rings and
checkerboards are not, and a patch of another texture pasted into a normal image is a local defect (its mask
kept, in MVTec AD's layout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

KINDS = ("horizontal", "vertical", "rings", "checker")


def texture(rng: np.random.Generator, kind: str, size: int = 32) -> np.ndarray:
    """One grey texture [size, size] in [0, 1]: a sinusoid of random period (5-9 px), phase and contrast, plus a
    little noise."""
    y, x = np.mgrid[:size, :size].astype(np.float64)
    period, phase = rng.uniform(5, 9), rng.uniform(0, 2 * np.pi)
    if kind == "horizontal":
        wave = np.sin(2 * np.pi * y / period + phase)
    elif kind == "vertical":
        wave = np.sin(2 * np.pi * x / period + phase)
    elif kind == "rings":
        cy, cx = rng.uniform(0, size, 2)
        wave = np.sin(2 * np.pi * np.hypot(y - cy, x - cx) / period + phase)
    elif kind == "checker":
        wave = np.tanh(3 * np.sin(np.pi * y / period + phase) * np.sin(np.pi * x / period + phase))
    else:
        raise ValueError(kind)
    contrast = rng.uniform(0.3, 0.45)
    return np.clip(0.5 + contrast * wave + rng.normal(0, 0.03, wave.shape), 0, 1)


def save(img: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((img * 255).round().astype(np.uint8)).convert("RGB").save(path)


def texture_set(root: Path, train: int = 96, test: int = 16, size: int = 32, seed: int = 0, defect: int = 12) -> Path:
    """root/train/good (horizontal stripes), root/test/good and test/<other kind> (`test` each), test/pasted
    (a square of vertical stripes, 9-12 px, pasted into horizontal stripes) with ground_truth/pasted masks."""
    rng = np.random.default_rng(seed)
    for i in range(train):
        save(texture(rng, "horizontal", size), root / "train" / "good" / f"{i:03d}.png")
    for kind in KINDS:
        for i in range(test):
            save(texture(rng, kind, size), root / "test" / ("good" if kind == "horizontal" else kind) / f"{i:03d}.png")
    for i in range(defect):
        img, patch = texture(rng, "horizontal", size), texture(rng, "vertical", size)
        side = int(rng.integers(9, 13))
        top, left = rng.integers(0, size - side, 2)
        mask = np.zeros((size, size), bool)
        mask[top : top + side, left : left + side] = True
        img[mask] = patch[mask]
        save(img, root / "test" / "pasted" / f"{i:03d}.png")
        (root / "ground_truth" / "pasted").mkdir(parents=True, exist_ok=True)
        Image.fromarray(mask.astype(np.uint8) * 255).save(root / "ground_truth" / "pasted" / f"{i:03d}_mask.png")
    return root
