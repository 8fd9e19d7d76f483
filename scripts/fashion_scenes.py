"""A segmentation benchmark that installs offline: scenes of 2-4 Fashion-MNIST garments at random positions and
sizes on a textured background, with per-pixel labels (0 = background, 1-10 = the ten garments), in the folder
layout `mae segment` reads. In the manner of M2NIST and the MultiMNIST segmentation sets.

    python scripts/fashion_scenes.py --output data/fashion_scenes
    mae pretrain --config recipes/segment/pretrain.yaml --data.path data/fashion_scenes/train/images

Writes, for each split, OUT/<split>/images/NAME.png (RGB), OUT/<split>/masks/NAME.png (palette PNG whose pixel
values are the class indices), OUT/<split>/classes.txt (one name per line, index order, background first) and
OUT/<split>/scenes.jsonl (per scene: each garment's index in its IDX file, label, position and side, in drawing
order).

- train: garments of the Fashion-MNIST train split, less 6,000 held out; val: garments of those 6,000 (for
  choosing settings without touching test); test: garments of the test split. No garment image crosses splits.
- A garment's pixels are those whose intensity, after resizing, is above --threshold; they are drawn opaque in
  a random colour, and a later garment hides what it covers (placements that would leave an earlier garment
  under --min_visible of its pixels are drawn again, up to 30 times).
- Background: real pixels, not noise. A 6-12 px crop of a random garment of the same split, blown up to the
  scene (soft blobs), plus an 8-px crop of another tiled across it (a fine repeating weave), scaled to a dim
  range and tinted; so no background is a plain colour and no two are alike.
- OUT/train_<P>pct (from --labeled_fraction, default 0.1): the first P% of the train scenes with their masks,
  for training the segmenter on a tenth of the labels while pretraining reads every train image.
- Scene i of a split depends only on (--seed, split, i): changing a count adds or drops scenes, the others stay.

Fashion-MNIST comes from Debian's `dataset-fashion-mnist` (IDX files in /usr/share/datasets/fashion-mnist/, MIT),
read by scripts/prepare_fashion_mnist.py's reader; --source takes any folder of the four IDX files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_fashion_mnist import CLASSES, DEBIAN, IDX, idx_file, read_idx  # noqa: E402

CLASS_NAMES = ["background", *CLASSES]
SPLITS = ("train", "val", "test")
VAL_HELD_OUT = 6000  # train-split garments kept for val scenes (a tenth of a smaller set), as in prepare_fashion_mnist
BACKGROUND_RANGE = (25.0, 115.0)  # background intensities: dimmer than most garment pixels, not all
# Mask colours (index 0 black): one clearly distinct colour per garment, for viewing the PNGs.
PALETTE = [0, 0, 0, 230, 25, 75, 60, 180, 75, 255, 225, 25, 0, 130, 200, 245, 130, 48,
           145, 30, 180, 70, 240, 240, 240, 50, 230, 210, 245, 60, 0, 128, 128]  # fmt: skip


def split_items(source: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """split -> (garments [N, 28, 28] uint8, labels [N], their indices in the IDX file [N]); val: a fixed 6,000
    of the train split (permutation of seed 0, whatever --seed), train: the rest; test: the test split."""
    files = {name: idx_file(source, name) for pair in IDX.values() for name in pair}
    missing = [name for name, path in files.items() if path is None]
    if missing:
        raise FileNotFoundError(
            f"--source {source}: lacks the IDX files {', '.join(missing)} (.gz or not); "
            "`apt-get install dataset-fashion-mnist` or point --source at a folder that has them"
        )
    train = [read_idx(files[name]) for name in IDX["train"]]
    test = [read_idx(files[name]) for name in IDX["test"]]
    order = np.random.default_rng(0).permutation(len(train[0]))
    held = min(VAL_HELD_OUT, len(order) // 10)
    fit, val = np.sort(order[held:]), np.sort(order[:held])
    every = np.arange(len(test[0]))
    return {"train": (*(a[fit] for a in train), fit), "val": (*(a[val] for a in train), val), "test": (*test, every)}


def background(rng: np.random.Generator, garments: np.ndarray, size: int) -> np.ndarray:
    """[size, size, 3] float: a blown-up crop of one garment (blobs) plus a tiled crop of another (weave)."""
    a, b = garments[rng.integers(len(garments), size=2)]
    side = int(rng.integers(6, 13))
    y, x = rng.integers(0, 29 - side, size=2)
    blobs = np.asarray(Image.fromarray(a[y : y + side, x : x + side]).resize((size, size), Image.BICUBIC), float)
    y, x = rng.integers(0, 21, size=2)
    reps = -(-size // 8)
    weave = np.tile(b[y : y + 8, x : x + 8].astype(float), (reps, reps))[:size, :size]
    mix = 0.65 * blobs + 0.35 * weave
    lo, hi = mix.min(), mix.max()
    mix = (mix - lo) / (hi - lo) if hi > lo else np.zeros_like(mix)
    low, high = BACKGROUND_RANGE
    tint = rng.uniform(0.6, 1.0, size=3)
    return (low + (high - low) * mix)[..., None] * tint


def place(rng: np.random.Generator, owner: np.ndarray, shape: np.ndarray, min_visible: float) -> tuple[int, int]:
    """(y, x) of `shape` (bool [s, s]) in the scene whose pixel owners are `owner` (-1 = background, k = item k):
    the first of 30 random places that leaves every earlier item at least `min_visible` of its pixels."""
    size, s = owner.shape[0], shape.shape[0]
    counts = np.bincount(owner[owner >= 0].ravel(), minlength=owner.max() + 1) if owner.max() >= 0 else None
    for _ in range(30):
        y, x = (int(v) for v in rng.integers(0, size - s + 1, size=2))
        if counts is None:
            return y, x
        covered = owner[y : y + s, x : x + s][shape]
        left = counts - np.bincount(covered[covered >= 0], minlength=len(counts))
        if np.all(left >= min_visible * counts):
            return y, x
    return y, x


def scene(rng: np.random.Generator, items: tuple[np.ndarray, np.ndarray], opts: argparse.Namespace):
    """One scene: (image [S, S, 3] uint8, mask [S, S] uint8 class indices, the items' records in drawing order)."""
    garments, labels, sources = items
    size = opts.size
    image = background(rng, garments, size)
    mask = np.zeros((size, size), np.uint8)
    owner = np.full((size, size), -1, np.int64)
    records = []
    lo, hi = (round(f * size) for f in opts.item_size)
    for k in range(int(rng.integers(opts.items[0], opts.items[1] + 1))):
        index = int(rng.integers(len(garments)))
        s = int(rng.integers(lo, hi + 1))
        pixels = np.asarray(Image.fromarray(garments[index]).resize((s, s), Image.BILINEAR), float)
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        shape = pixels > opts.threshold
        y, x = place(rng, owner, shape, opts.min_visible)
        colour = rng.uniform(0.55, 1.0, size=3)
        window = (slice(y, y + s), slice(x, x + s))
        image[window][shape] = pixels[shape][:, None] * colour
        mask[window][shape] = labels[index] + 1
        owner[window][shape] = k
        records.append({"source": int(sources[index]), "label": int(labels[index]) + 1, "y": y, "x": x, "size": s})
    return image.round().clip(0, 255).astype(np.uint8), mask, records


def mask_png(mask: np.ndarray) -> Image.Image:
    """A palette PNG: pixel values are the class indices, the palette only colours them for viewing."""
    img = Image.fromarray(mask, mode="P")
    img.putpalette(PALETTE)
    return img


def write_split(out: Path, split: str, count: int, items, opts: argparse.Namespace) -> list[dict]:
    """OUT/<split>/{images,masks}/NAME.png, classes.txt and scenes.jsonl; returns the scenes' records."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    (out / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    records = []
    for i in range(count):
        rng = np.random.default_rng([opts.seed, SPLITS.index(split), i])
        image, mask, placed = scene(rng, items, opts)
        name = f"{split}_{i:05d}"
        Image.fromarray(image).save(out / "images" / f"{name}.png")
        mask_png(mask).save(out / "masks" / f"{name}.png")
        records.append({"name": name, "items": placed})
    (out / "scenes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def write_labeled_subset(out: Path, train: Path, records: list[dict], fraction: float) -> Path:
    """OUT/train_<P>pct: the first `fraction` of the train scenes (scenes are independent draws), files copied."""
    folder = out / f"train_{round(fraction * 100)}pct"
    kept = records[: max(1, round(fraction * len(records)))]
    for sub in ("images", "masks"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for r in kept:
            (folder / sub / f"{r['name']}.png").write_bytes((train / sub / f"{r['name']}.png").read_bytes())
    (folder / "classes.txt").write_text((train / "classes.txt").read_text())
    (folder / "scenes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="data/fashion_scenes", help="folder for train/, val/, test/, train_<P>pct/")
    p.add_argument("--source", default=str(DEBIAN), help="folder of Fashion-MNIST's four IDX files (.gz or not)")
    p.add_argument("--size", type=int, default=64, help="scene side in pixels (8x8 patches of 8 px at 64)")
    p.add_argument("--train", type=int, default=6000, help="number of train scenes")
    p.add_argument("--val", type=int, default=1000, help="number of val scenes (held-out train-split garments)")
    p.add_argument("--test", type=int, default=1000, help="number of test scenes (test-split garments)")
    p.add_argument("--items", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"), help="garments per scene")
    p.add_argument("--item_size", type=float, nargs=2, default=[0.3, 0.55], metavar=("MIN", "MAX"),
                   help="garment side as a fraction of the scene side (a 28-px garment is resized to it)")  # fmt: skip
    p.add_argument("--threshold", type=float, default=20, help="intensity (0-255) above which a pixel is garment")
    p.add_argument("--min_visible", type=float, default=0.4, help="share of each garment later ones may not hide")
    p.add_argument(
        "--labeled_fraction", type=float, default=0.1, help="share of train scenes in train_<P>pct/ (0: none)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    checks = [
        (args.size >= 16, f"--size {args.size}: at least 16"),
        (1 <= args.items[0] <= args.items[1], f"--items {args.items}: MIN >= 1 and MIN <= MAX"),
        (0 < args.item_size[0] <= args.item_size[1] <= 1, f"--item_size {args.item_size}: 0 < MIN <= MAX <= 1"),
        (round(args.item_size[0] * args.size) >= 4, f"--item_size {args.item_size}: garments under 4 px at this size"),
        (0 <= args.labeled_fraction < 1, f"--labeled_fraction {args.labeled_fraction}: in [0, 1)"),
        (min(args.train, args.val, args.test) >= 0, "--train/--val/--test: counts are >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            p.exit(2, f"fashion_scenes: {message}\n")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        items = split_items(Path(args.source))
    except FileNotFoundError as e:
        print(f"fashion_scenes: {e}", file=sys.stderr)
        return 2
    out = Path(args.output)
    counts = {"train": args.train, "val": args.val, "test": args.test}
    for split in SPLITS:
        records = write_split(out / split, split, counts[split], items[split], args)
        print(f"{out / split}: {len(records)} scenes of {args.size}x{args.size}")
        if split == "train" and args.labeled_fraction > 0 and records:
            folder = write_labeled_subset(out, out / "train", records, args.labeled_fraction)
            print(f"{folder}: {len(list((folder / 'masks').iterdir()))} labeled train scenes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
