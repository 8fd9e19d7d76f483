"""scripts/defect_photos.py: MVTec AD's layout, seeded, masks only for defects and exactly where the image changed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "defect_photos.py"
DEFECTS = ("cut_paste", "scratch", "blotch")


def load_script():
    spec = importlib.util.spec_from_file_location("defect_photos", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--output", str(out), "--categories", "brick,coffee", "--size", "48", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("photos")
    proc = generate(out, "--train", "4", "--test_good", "3", "--test_defect", "3")
    assert proc.returncode == 0, proc.stderr
    return out


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_layout(photos):
    assert names(photos) == ["brick", "coffee"]
    for category in ("brick", "coffee"):
        root = photos / category
        assert names(root) == ["ground_truth", "test", "train"]
        assert names(root / "train") == ["good"] and len(names(root / "train" / "good")) == 4
        assert names(root / "test") == sorted(["good", *DEFECTS]) and len(names(root / "test" / "good")) == 3
        assert names(root / "ground_truth") == sorted(DEFECTS)  # no masks for normal images
        for kind in DEFECTS:
            images = names(root / "test" / kind)
            assert images == ["0000.png", "0001.png", "0002.png"]
            assert names(root / "ground_truth" / kind) == [n.replace(".png", "_mask.png") for n in images]
        for image in (root / "train" / "good").iterdir():
            a = np.asarray(Image.open(image))
            assert a.shape == (48, 48, 3) and a.dtype == np.uint8


def test_masks_non_empty_binary_and_sized(photos):
    for category in ("brick", "coffee"):
        for kind in DEFECTS:
            for image in (photos / category / "test" / kind).iterdir():
                mask = Image.open(photos / category / "ground_truth" / kind / f"{image.stem}_mask.png")
                m = np.asarray(mask)
                assert mask.mode == "L" and m.shape == (48, 48)
                assert set(np.unique(m)) == {0, 255}  # non-empty, and not the whole image


def test_seeded_and_stable_under_counts(photos, tmp_path):
    assert generate(tmp_path / "a", "--train", "2", "--test_good", "1", "--test_defect", "1").returncode == 0
    assert (
        generate(tmp_path / "b", "--train", "2", "--test_good", "1", "--test_defect", "1", "--seed", "1").returncode
        == 0
    )
    files = ["brick/train/good/0001.png", "coffee/test/good/0000.png", "brick/test/scratch/0000.png"]
    files += ["coffee/ground_truth/blotch/0000_mask.png"]
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (photos / rel).read_bytes()
        assert (tmp_path / "b" / rel).read_bytes() != (photos / rel).read_bytes()


@pytest.mark.parametrize("kind", DEFECTS)
def test_defect_changes_only_its_mask(kind):
    """Outside the mask a defect image equals the normal crop it was drawn on; inside, it differs clearly."""
    script = load_script()
    sources = script.load_sources(["gravel", "coffee"])
    rng = np.random.default_rng(0)
    for _ in range(5):
        base = script.crop(rng, sources["gravel"], script.half(sources["gravel"], "test"), 64)
        image, mask = script.defect(rng, kind, base, [sources["coffee"]])
        before = np.asarray(script.to_png(base))
        assert mask.any() and not mask.all()
        np.testing.assert_array_equal(image[~mask], before[~mask])
        assert np.abs(image[mask].astype(float) - before[mask]).mean() >= script.MIN_CHANGE


def test_train_and_test_crops_from_separate_halves():
    """A source black on its left half and white on its right: train crops come out dark, test crops bright."""
    script = load_script()
    source = np.zeros((100, 300, 3), np.uint8)
    source[:, 150:] = 255
    rng = np.random.default_rng(0)
    for _ in range(10):
        assert script.crop(rng, source, script.half(source, "train"), 32).max() < 20
        assert script.crop(rng, source, script.half(source, "test"), 32).min() > 235


def test_unknown_category_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--output", str(tmp_path), "--categories", "brick,no_such_photo"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no_such_photo" in proc.stderr
