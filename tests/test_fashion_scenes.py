"""scripts/fashion_scenes.py on small IDX files whose garments are known: train garments are solid squares of
intensity 230-255, test garments of 60-100, and class 3's images are black (no pixel above the threshold), so
the expected mask of a scene can be painted from its scenes.jsonl alone."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fashion_scenes.py"
N_TRAIN, N_TEST = 200, 60  # the script holds out a tenth of a train split this small for val: 20
BLACK = 3  # class whose garments are all zero


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def idx(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    src = tmp_path_factory.mktemp("idx")
    for prefix, n, (lo, hi) in (("train", N_TRAIN, (230, 256)), ("t10k", N_TEST, (60, 101))):
        labels = np.arange(n) % 10
        images = rng.integers(lo, hi, (n, 28, 28))
        images[labels == BLACK] = 0
        write_idx(src / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return src


def generate(idx: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--source", str(idx), "--output", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def scenes(idx, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scenes")
    proc = generate(idx, out, "--train", "30", "--val", "8", "--test", "12", "--size", "48")
    assert proc.returncode == 0, proc.stderr
    return out


def read(split_dir: Path, kind: str, name: str) -> np.ndarray:
    return np.asarray(Image.open(split_dir / kind / f"{name}.png"))


def records(split_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (split_dir / "scenes.jsonl").read_text().splitlines()]


def test_layout_sizes_and_label_set(scenes):
    for split, count in (("train", 30), ("val", 8), ("test", 12)):
        folder = scenes / split
        names = sorted(p.stem for p in (folder / "images").iterdir())
        assert len(names) == count and names == sorted(p.stem for p in (folder / "masks").iterdir())
        classes = (folder / "classes.txt").read_text().splitlines()
        assert len(classes) == 11 and classes[0] == "background" and classes[1] == "T-shirt/top"
        for name in names:
            image, mask = read(folder, "images", name), read(folder, "masks", name)
            assert image.shape == (48, 48, 3) and mask.shape == (48, 48) and mask.dtype == np.uint8
            assert set(np.unique(mask)) <= set(range(11)) and mask.max() > 0


def test_every_garment_pixel_labelled(scenes):
    """The mask equals the scene's garments painted in drawing order (solid squares: every pixel is garment),
    black garments leave no label, and each garment's visible pixels are its own colour in the image."""
    seen_black = False
    for split in ("train", "val", "test"):
        for r in records(scenes / split):
            expected = np.zeros((48, 48), np.uint8)
            for item in r["items"]:
                assert 2 <= len(r["items"]) <= 4
                seen_black |= item["label"] == BLACK + 1
                if item["label"] != BLACK + 1:
                    expected[item["y"] : item["y"] + item["size"], item["x"] : item["x"] + item["size"]] = item["label"]
            mask = read(scenes / split, "masks", r["name"])
            np.testing.assert_array_equal(mask, expected)
            assert BLACK + 1 not in np.unique(mask)
    assert seen_black  # the threshold was put to the test


def test_splits_draw_from_their_own_garments(scenes):
    """Train and val scenes hold train-split garments (bright), disjoint sets of them; test scenes hold
    test-split garments (dim): garment pixels of a test scene never reach the train garments' range."""
    sources = {s: {i["source"] for r in records(scenes / s) for i in r["items"]} for s in ("train", "val", "test")}
    assert not sources["train"] & sources["val"]
    assert max(sources["test"]) < N_TEST
    for split in ("train", "val", "test"):
        for r in records(scenes / split):
            image, mask = read(scenes / split, "images", r["name"]), read(scenes / split, "masks", r["name"])
            garment = image[mask > 0].max(axis=1)  # brightest channel of each garment pixel (colours are >= 0.55)
            if split == "test":
                assert garment.max() <= 100
            else:
                assert garment.min() >= int(0.55 * 230)


def test_seeded_and_stable_under_counts(idx, scenes, tmp_path):
    """The same seed gives the same bytes; scene i does not depend on how many scenes are drawn; another seed
    gives other scenes."""
    assert generate(idx, tmp_path / "a", "--train", "10", "--val", "1", "--test", "2", "--size", "48").returncode == 0
    other_seed = generate(
        idx, tmp_path / "b", "--train", "10", "--val", "1", "--test", "2", "--size", "48", "--seed", "1"
    )
    assert other_seed.returncode == 0
    for kind in ("images", "masks"):
        for i in range(10):
            name = f"train_{i:05d}.png"
            a, full = (tmp_path / "a" / "train" / kind / name).read_bytes(), (scenes / "train" / kind / name)
            assert a == full.read_bytes()
    other = [read(tmp_path / "b" / "train", "images", f"train_{i:05d}") for i in range(10)]
    same = [read(tmp_path / "a" / "train", "images", f"train_{i:05d}") for i in range(10)]
    assert not any(np.array_equal(x, y) for x, y in zip(other, same, strict=True))


def test_labeled_fraction(scenes, idx, tmp_path):
    """train_10pct holds the first tenth of the train scenes, bytes identical, with classes.txt."""
    folder = scenes / "train_10pct"
    assert sorted(p.name for p in (folder / "masks").iterdir()) == [
        "train_00000.png",
        "train_00001.png",
        "train_00002.png",
    ]
    for kind in ("images", "masks"):
        for p in (folder / kind).iterdir():
            assert p.read_bytes() == (scenes / "train" / kind / p.name).read_bytes()
    assert (folder / "classes.txt").read_text() == (scenes / "train" / "classes.txt").read_text()
    proc = generate(idx, tmp_path / "none", "--train", "4", "--val", "0", "--test", "0", "--labeled_fraction", "0")
    assert proc.returncode == 0 and not list(tmp_path.glob("none/train_*pct"))


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--items", "3", "2"], "--items"), (["--labeled_fraction", "1"], "--labeled_fraction"), ([], "lacks the IDX")],
)
def test_one_line_errors(tmp_path, args, message):
    proc = generate(tmp_path, tmp_path / "out", *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr
