"""Small generated segmentation folders: images/ and masks/ of the same names, learnable from the pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def make_segmentation(root, n=16, size=(32, 32), seed=0, classes=2, palette=False, names=None) -> Path:
    """`n` images of (H, W) `size`: a smooth random texture (dark) with 1-2 bright rectangles per image whose class
    (1 .. classes-1) is their dominant hue; mask = class index per pixel, 0 background. Palette PNG masks with
    `palette`; a classes.txt with `names`."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    h, w = size
    for i in range(n):
        coarse = rng.uniform(0, 90, (4, 4, 3)).astype("uint8")
        img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), float)
        mask = np.zeros((h, w), np.uint8)
        for _ in range(rng.integers(1, 3)):
            c = int(rng.integers(1, classes))
            bh, bw = int(rng.integers(h // 4, h // 2)), int(rng.integers(w // 4, w // 2))
            top, left = int(rng.integers(0, h - bh)), int(rng.integers(0, w - bw))
            colour = np.full(3, 110.0)
            colour[(c - 1) % 3] = 255.0
            img[top : top + bh, left : left + bw] = colour
            mask[top : top + bh, left : left + bw] = c
        img = (img + rng.normal(0, 8, img.shape)).clip(0, 255).astype("uint8")
        Image.fromarray(img).save(root / "images" / f"s{i:03d}.png")
        m = Image.frombytes("P" if palette else "L", (w, h), mask.tobytes())
        if palette:
            m.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 12))
        m.save(root / "masks" / f"s{i:03d}.png")
    if names:
        (root / "classes.txt").write_text("\n".join(names) + "\n")
    return root
