"""Labeled images for probing, fine-tuning and k-NN: class folders or `datasets` with a label column.

A labeled source is an image source (`len`, `load(i)`, `name(i)`) with `labels` (int64 array)
and `classes` (names, index = label).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from mae.data.sources import (
    IMAGE_EXTENSIONS,
    DataError,
    FolderSource,
    HFSource,
    is_text,
    iter_image_files,
    load_hf_dataset,
)
from mae.data.transforms import DecodedImages, sample_seed, split_bad


class LabeledFolder(FolderSource):
    """`root/<class>/**/<image>`: one subfolder per class, sorted by name."""

    def __init__(self, root: str | Path, option: str = "--data.path") -> None:
        root = Path(root)
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if len(classes) < 2:
            raise DataError(
                f"{option} {root}: a labeled folder needs one subfolder per class, and at least two classes "
                f"(found {len(classes)})"
            )
        _check_class_layout(root, classes, option)
        paths, labels = [], []
        for label, name in enumerate(classes):
            files = sorted(iter_image_files(root / name))
            if not files:
                raise DataError(f"{option} {root}: class folder '{name}' has no images; remove it or add some")
            paths += files
            labels += [label] * len(files)
        super().__init__(root, paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = classes


def _images_in(folder: Path) -> list[str]:
    """Names of the image files directly in `folder` (as `iter_image_files` counts them: links not followed)."""
    return [
        e.name
        for e in os.scandir(folder)
        if not e.is_dir(follow_symlinks=False) and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS
    ]


def _check_class_layout(root: Path, classes: list[str], option: str) -> None:
    """Refuse folders whose subfolders are evidently not classes, rather than train on made-up labels."""
    loose = _images_in(root)
    if loose:
        raise DataError(
            f"{option} {root}: {len(loose)} images (e.g. {loose[0]}) sit directly in the folder, outside any class "
            "subfolder; a labeled folder holds one subfolder per class with that class's images (unlabeled images "
            "are for mae pretrain)"
        )
    if any(_images_in(root / c) for c in classes):
        return
    inner = [frozenset(e.name for e in os.scandir(root / c) if e.is_dir()) for c in classes]
    if inner[0] and all(names == inner[0] for names in inner):
        raise DataError(
            f"{option} {root}: this looks like an unlabeled nested folder, not class folders: every subfolder "
            f"({', '.join(classes[:4])}{', ...' if len(classes) > 4 else ''}) holds the same subfolders "
            f"({', '.join(sorted(inner[0])[:4])}) and no images of its own; give each class its own subfolder"
        )


class LabeledHF(HFSource):
    """A `datasets.Dataset` with an image column and a label column: ClassLabel, integers, or class names."""

    def __init__(self, dataset, image_column: str | None, label_column: str | None, label: str) -> None:
        from datasets import ClassLabel

        feats = dataset.features
        if label_column is None:
            found = [c for c, f in feats.items() if isinstance(f, ClassLabel)]
            label_column = found[0] if found else ("label" if "label" in feats else None)
        if label_column is None or label_column not in feats:
            raise DataError(f"{label}: no label column (columns: {list(feats)}); set --data.label_column")
        if is_text(feats[label_column]):  # class names: classes in name order, as class folders are
            dataset = dataset.class_encode_column(label_column)
            feats = dataset.features
        labels = np.asarray(dataset[label_column], dtype=np.int64)
        feature = feats[label_column]
        if isinstance(feature, ClassLabel):
            classes = list(feature.names)
        else:
            classes = [str(i) for i in range(int(labels.max()) + 1)] if len(labels) else []
        bad = np.flatnonzero((labels < 0) | (labels >= len(classes)))
        if len(bad):
            raise DataError(
                f"{label}: label {labels[bad[0]]} of row {bad[0]} is outside [0, {len(classes)}) "
                f"({len(bad)} such rows); fix the '{label_column}' column"
            )
        super().__init__(dataset, image_column, label)
        self.labels, self.classes = labels, classes


class Subset:
    """Some rows of a labeled source (a held-out split), with the same interface."""

    def __init__(self, source, indices: np.ndarray) -> None:
        self.source, self.indices = source, np.asarray(indices)
        self.labels, self.classes = source.labels[self.indices], source.classes

    def __len__(self) -> int:
        return len(self.indices)

    def load(self, i: int):
        return self.source.load(int(self.indices[i]))

    def load_array(self, i: int):
        return self.source.load_array(int(self.indices[i]))

    def name(self, i: int) -> str:
        return self.source.name(int(self.indices[i]))


def open_labeled(path: str, image_column: str | None, label_column: str | None, option: str = "--data.path"):
    from mae.data.shards import is_shard_set, open_shards

    if is_shard_set(path):
        return open_shards(path, option, labeled=True)
    if not path.startswith("hf:") and not Path(path).is_dir():
        raise DataError(f"{option} {path}: no such folder (expected class subfolders or a saved `datasets` folder)")
    ds = load_hf_dataset(path, option)
    return LabeledHF(ds, image_column, label_column, path) if ds is not None else LabeledFolder(Path(path), option)


def split(source, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(train, held-out) with `fraction` of the rows held out, chosen by `seed`."""
    order = np.random.default_rng(seed).permutation(len(source))
    n_val = max(1, round(fraction * len(source)))
    return Subset(source, np.sort(order[n_val:])), Subset(source, np.sort(order[:n_val]))


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Seed torch, `random` and NumPy (timm's augmentations use all three) for one sample. torch's state is
    restored after; `random` and NumPy are reseeded from a number drawn from their own stream before,
    so they go on as a function of their earlier state alone, whatever the sample's seed (saving and
    restoring their states took ~150 us, a third of a 28-px fine-tuning sample's time)."""
    torch_state = torch.random.get_rng_state()
    after = random.getrandbits(64), int(np.random.randint(2**32, dtype=np.uint64))
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that also queues CUDA seeding (slow)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        random.seed(after[0])
        np.random.seed(after[1])


class LabeledSamples(torch.utils.data.Dataset):
    """`dataset[(epoch, index)]` or `dataset[index]` -> {"image", "label", "index"}, or {"bad": (name, reason)}
    for a file that cannot be decoded. With a `seed`, the transform's randomness comes from (seed, epoch, index)."""

    def __init__(
        self,
        source,
        transform: Callable,
        seed: int | None = None,
        decode_side: int | None = None,
        in_chans: int = 3,
    ) -> None:
        self.source, self.transform, self.seed, self.in_chans = source, transform, seed, in_chans
        self.load = DecodedImages(source, in_chans)
        target = source.source if isinstance(source, Subset) else source
        if decode_side and hasattr(target, "set_decode_size"):
            target.set_decode_size(decode_side)  # large JPEGs decode at a reduced scale (see FolderSource)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        img, bad = self.load(index)
        return bad if bad is not None else self.prepare(img, epoch, index, int(self.source.labels[index]))

    def prepare(self, img, epoch: int, index: int, label: int) -> dict:
        """A loaded image -> the sample, its randomness (with a seed) from (seed, epoch, index)."""
        if self.seed is None:
            x = self.transform(img)
        else:
            with seeded_rng(sample_seed(self.seed, epoch, index)):
                x = self.transform(img)
        return {"image": x, "label": label, "index": index}


def collate_labeled(samples: list[dict]) -> dict:
    good, bad = split_bad(samples)
    if not good:
        return {"image": None, "label": None, "index": None, "bad": bad}
    return {
        "image": torch.stack([s["image"] for s in good]),
        "label": torch.tensor([s["label"] for s in good]),
        "index": torch.tensor([s["index"] for s in good]),
        "bad": bad,
    }


def eval_transform(size: tuple[int, int], *, crop_pct: float, mean: tuple, std: tuple, in_chans: int = 3) -> Callable:
    """Evaluation: resize to size / crop_pct, centre-crop `size`, normalise. timm's for RGB (PIL in);
    the same steps on float tensors [C, H, W] for any other channel count."""
    if in_chans == 3:
        from timm.data import create_transform

        return create_transform(
            (3, *size), is_training=False, crop_pct=crop_pct, interpolation="bicubic", mean=mean, std=std
        )
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(math.floor(min(size) / crop_pct), interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
            v2.CenterCrop(list(size)),
            v2.Normalize(list(mean), list(std)),
        ]
    )


def train_transform(
    size: tuple[int, int],
    *,
    scale: tuple[float, float],
    mean: tuple,
    std: tuple,
    auto_augment: str | None = None,
    re_prob: float = 0.0,
    in_chans: int = 3,
) -> Callable:
    """timm's training transform (random-resized crop, flip, optional RandAugment and random erasing),
    bicubic, with posterize made safe on Pillow >= 13 (see `_posterize`). For another channel count the
    crop, flip and random erasing run on float tensors; RandAugment, whose ops are RGB image ops, is left
    out (warned)."""
    if in_chans != 3:
        import warnings

        from timm.data.random_erasing import RandomErasing
        from torchvision.transforms import v2

        if auto_augment:
            warnings.warn(f"{in_chans}-channel images: RandAugment ({auto_augment}) works on RGB only, left out",
                          stacklevel=2)  # fmt: skip
        steps = [
            v2.RandomResizedCrop(
                list(size), scale=tuple(scale), interpolation=v2.InterpolationMode.BICUBIC, antialias=True
            ),
            v2.RandomHorizontalFlip(),
            v2.Normalize(list(mean), list(std)),
        ]
        if re_prob > 0:
            steps.append(RandomErasing(re_prob, mode="pixel", max_count=1, device="cpu"))
        return v2.Compose(steps)
    from timm.data import create_transform

    transform = create_transform(
        (3, *size),
        is_training=True,
        scale=tuple(scale),
        hflip=0.5,
        color_jitter=None,
        auto_augment=auto_augment,
        re_prob=re_prob,
        re_mode="pixel",
        re_count=1,
        interpolation="bicubic",
        mean=mean,
        std=std,
    )
    from timm.data.auto_augment import posterize

    for t in getattr(transform, "transforms", []):
        policy = getattr(t, "ops", None) or [op for sub in getattr(t, "policy", []) for op in sub]
        for op in policy:
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize
    return transform


def _posterize(img, bits_to_keep: int, **kwargs):
    """timm's posterize, keeping the reference meaning of 0 bits (a black image: TF's shift by 8, and
    Pillow before 13). Pillow 13 refuses 0 bits, and the increasing posterize of `rand-m9-mstd0.5-inc1`
    asks for 0 when the sampled magnitude reaches 10."""
    from PIL import Image
    from timm.data.auto_augment import posterize

    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)
