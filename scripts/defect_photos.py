"""A colour anomaly benchmark that installs offline: MVTec AD's layout made from the photos and textures that ship
inside scikit-image (CC0 / public domain, no download). A category is one source image; its normal images are
random crops with mild jitter, its defects are drawn onto other crops, and every defect keeps its mask.

    python scripts/defect_photos.py --output data/defect_photos
    mae anomaly --pretrained RUN --data.path data/defect_photos/brick/test --normal good --output_dir OUT

Layout, per category (as MVTec AD, so `mae anomaly` finds the masks and reports pixel AUROC):

    OUT/<category>/train/good/NNNN.png              normal crops, for pretraining or fitting
    OUT/<category>/test/good/NNNN.png               normal crops, never seen in train
    OUT/<category>/test/<defect>/NNNN.png           a normal-looking crop with one defect
    OUT/<category>/ground_truth/<defect>/NNNN_mask.png   255 where the defect changed the image, 0 elsewhere

- Train and test crops come from the two halves of the source image (split across its longer side), so a test
  image never repeats a train image's pixels. A crop's side is 0.3 of the source's shorter side (+-10%),
  resized to --size; jitter: horizontal flip, brightness and contrast within +-5%.
- Defects, hard-edged (the mask is the defect's region; every pixel outside it is untouched): cut_paste (a
  rectangle cut from another category's source, 12-25% of the side), scratch (a 1-3 px polyline, dark, light
  or coloured), blotch (a translucent stain of one saturated colour, a union of two ellipses, 5-12% of the side
  across). A defect that changes its region by under 20 grey levels on average is drawn again.
- Each image depends only on (--seed, category, folder, index): changing a count keeps the others.
"""

from __future__ import annotations

import argparse
import colorsys
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CATEGORIES = ("brick", "grass", "gravel", "coffee", "immunohistochemistry")


def load_sources(names: list[str]) -> dict[str, np.ndarray]:
    """name -> [H, W, 3] uint8 of scikit-image's bundled image `skimage.data.<name>()` (grayscale repeated)."""
    import skimage.data

    sources = {}
    for name in names:
        try:
            a = np.asarray(getattr(skimage.data, name)())
        except Exception as e:  # noqa: BLE001 - a name the installed version lacks, or one that needs a download
            raise ValueError(f"--categories {name}: not an image bundled with scikit-image ({type(e).__name__})") from e
        sources[name] = np.asarray(Image.fromarray(a).convert("RGB"))
    return sources


def half(image: np.ndarray, split: str) -> np.ndarray:
    """The first half of the image across its longer side for train, the second for test."""
    h, w = image.shape[:2]
    if w >= h:
        return image[:, : w // 2] if split == "train" else image[:, w // 2 :]
    return image[: h // 2] if split == "train" else image[h // 2 :]


def crop(rng: np.random.Generator, image: np.ndarray, region: np.ndarray, size: int) -> np.ndarray:
    """A jittered random crop of `region` (a half of `image`), [size, size, 3] float in 0-255."""
    side = min(int(0.3 * min(image.shape[:2]) * rng.uniform(0.9, 1.1)), *region.shape[:2])
    y = int(rng.integers(0, region.shape[0] - side + 1))
    x = int(rng.integers(0, region.shape[1] - side + 1))
    patch = Image.fromarray(region[y : y + side, x : x + side]).resize((size, size), Image.BICUBIC)
    out = np.asarray(patch, float)
    if rng.random() < 0.5:
        out = out[:, ::-1]
    mean = out.mean()
    return ((out - mean) * rng.uniform(0.95, 1.05) + mean) * rng.uniform(0.95, 1.05)


def cut_paste(rng: np.random.Generator, image: np.ndarray, others: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A rectangle of another category's source (12-25% of the side each way) pasted at a random place."""
    size = image.shape[0]
    h, w = (int(v) for v in rng.integers(round(0.12 * size), round(0.25 * size) + 1, size=2))
    other = others[int(rng.integers(len(others)))]
    piece = crop(rng, other, other, size)[:h, :w]
    y, x = (int(v) for v in rng.integers(0, size - np.array([h, w]) + 1))
    mask = np.zeros(image.shape[:2], bool)
    mask[y : y + h, x : x + w] = True
    out = image.copy()
    out[y : y + h, x : x + w] = piece
    return out, mask


def scratch(rng: np.random.Generator, image: np.ndarray, others: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A thin polyline of 2-3 segments across the image, dark, light or coloured."""
    size = image.shape[0]
    start = rng.uniform(0.1, 0.9, size=2) * size
    points = [tuple(start)]
    for _ in range(int(rng.integers(2, 4))):
        step = rng.uniform(0.1, 0.3) * size
        angle = rng.uniform(0, 2 * np.pi)
        points.append(tuple(np.clip(np.array(points[-1]) + step * np.array([np.cos(angle), np.sin(angle)]), 0, size)))
    canvas = Image.new("L", (size, size))
    ImageDraw.Draw(canvas).line(points, fill=255, width=int(rng.integers(1, 4)))
    mask = np.asarray(canvas) > 0
    colour = [np.full(3, 20.0), np.full(3, 235.0), rng.uniform(0, 255, size=3)][int(rng.integers(3))]
    out = image.copy()
    out[mask] = colour
    return out, mask


def blotch(rng: np.random.Generator, image: np.ndarray, others: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A translucent stain of a saturated colour far from the image's own, shaped as a union of two ellipses."""
    size = image.shape[0]
    canvas = Image.new("L", (size, size))
    draw = ImageDraw.Draw(canvas)
    centre = rng.uniform(0.2, 0.8, size=2) * size
    for _ in range(2):
        c = centre + rng.uniform(-0.04, 0.04, size=2) * size
        r = rng.uniform(0.025, 0.06, size=2) * size
        draw.ellipse([c[0] - r[0], c[1] - r[1], c[0] + r[0], c[1] + r[1]], fill=255)
    mask = np.asarray(canvas) > 0
    mean = image[mask].mean(axis=0)
    for _ in range(20):  # a hue whose colour stands apart from what it stains
        colour = np.array(colorsys.hsv_to_rgb(rng.uniform(), 1.0, rng.uniform(0.7, 1.0))) * 255
        if np.abs(colour - mean).max() > 80:
            break
    alpha = rng.uniform(0.5, 0.75)
    out = image.copy()
    out[mask] = (1 - alpha) * image[mask] + alpha * colour
    return out, mask


def to_png(a: np.ndarray) -> Image.Image:
    return Image.fromarray(np.ascontiguousarray(a).round().clip(0, 255).astype(np.uint8))


# defect name -> (rng, image [S, S, 3] float, the other categories' sources) -> (image, mask [S, S] bool)
DEFECTS = {"cut_paste": cut_paste, "scratch": scratch, "blotch": blotch}
MIN_CHANGE = 20  # mean absolute change (0-255) inside the mask below which a defect is drawn again


def defect(rng: np.random.Generator, kind: str, base: np.ndarray, others: list[np.ndarray]):
    """(image uint8, mask bool) of `kind` drawn on `base`, redrawn (up to 10 times) while it changes too little
    (a scratch of the texture's own colour); pixels outside the mask are the base's."""
    for _ in range(10):
        image, mask = DEFECTS[kind](rng, base, others)
        after = np.asarray(to_png(image))
        if np.abs(after[mask].astype(float) - np.asarray(to_png(base))[mask]).mean() >= MIN_CHANGE:
            break
    return after, mask


def write_category(out: Path, name: str, sources: dict[str, np.ndarray], opts: argparse.Namespace) -> int:
    """Every image and mask of one category; returns how many images were written."""
    image, others = sources[name], [v for k, v in sources.items() if k != name] or [sources[name]]
    key = zlib.crc32(name.encode())
    written = 0
    plan = [("train", "good", opts.train), ("test", "good", opts.test_good)]
    plan += [("test", kind, opts.test_defect) for kind in DEFECTS]
    for part, (split, kind, count) in enumerate(plan):
        folder = out / name / split / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            rng = np.random.default_rng([opts.seed, key, part, i])
            base = crop(rng, image, half(image, split), opts.size)
            if kind == "good":
                to_png(base).save(folder / f"{i:04d}.png")
            else:
                pixels, mask = defect(rng, kind, base, others)
                Image.fromarray(pixels).save(folder / f"{i:04d}.png")
                truth = out / name / "ground_truth" / kind
                truth.mkdir(parents=True, exist_ok=True)
                Image.fromarray((mask * 255).astype(np.uint8)).save(truth / f"{i:04d}_mask.png")
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="data/defect_photos", help="folder for one subfolder per category")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="skimage.data image names, comma-separated")
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument("--train", type=int, default=200, help="normal train images per category")
    p.add_argument("--test_good", type=int, default=40, help="normal test images per category")
    p.add_argument("--test_defect", type=int, default=20, help="test images per category and defect type")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.size < 32 or min(args.train, args.test_good, args.test_defect) < 0:
        p.exit(2, f"defect_photos: --size {args.size} must be >= 32 and every count >= 0\n")
    try:
        sources = load_sources([c for c in args.categories.split(",") if c])
    except ValueError as e:
        p.exit(2, f"defect_photos: {e}\n")
    for name in sources:
        n = write_category(Path(args.output), name, sources, args)
        print(f"{Path(args.output) / name}: {n} images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
