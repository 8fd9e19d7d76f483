"""Labeled data: the fine-tuning transform at every augmentation and magnitude."""

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from mae.config import AugmentConfig
from mae.data.hf import LabeledHF
from mae.data.transforms import train_transform
from mae.errors import DataError


def _image(seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))


def _randaugment(transform):
    found = [t for t in transform.transforms if hasattr(t, "ops")]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("magnitude", [0, 5, 9, 10])  # rand-m9-mstd0.5 samples magnitudes in [0, 10]
def test_every_randaugment_op_runs_at_every_magnitude(magnitude):
    policy = AugmentConfig().auto_augment.replace("m9", f"m{magnitude}").replace("mstd0.5", "mstd0")
    tf = train_transform((32, 32), scale=(0.08, 1.0), mean=(0.5,) * 3, std=(0.5,) * 3, auto_augment=policy)
    ops = _randaugment(tf).ops
    assert len(ops) >= 14
    for op in ops:
        op.prob = 1.0
        out = op(_image())
        assert out.size == (48, 40) and out.mode == "RGB", op.name
    names = {op.name for op in ops}
    assert "PosterizeIncreasing" in names


def test_posterize_at_the_top_magnitude_keeps_the_reference_meaning():
    tf = train_transform(
        (32, 32), scale=(0.08, 1.0), mean=(0.5,) * 3, std=(0.5,) * 3, auto_augment="rand-m10-mstd0-inc1"
    )
    op = next(op for op in _randaugment(tf).ops if op.name == "PosterizeIncreasing")
    op.prob = 1.0
    assert np.asarray(op(_image())).max() == 0  # 0 bits kept: black, as TF's reference and Pillow < 13 gave


def test_the_default_finetune_transform_runs_many_times():
    a = AugmentConfig()
    tf = train_transform((32, 32), scale=a.crop_scale, mean=(0.5,) * 3, std=(0.5,) * 3, auto_augment=a.auto_augment,
                         re_prob=a.reprob)  # fmt: skip
    for seed in range(300):
        torch.manual_seed(seed)
        np.random.seed(seed)
        x = tf(_image(seed))
        assert x.shape == (3, 32, 32) and torch.isfinite(x).all()


def test_folders_that_are_not_class_folders_are_refused(tmp_path):
    from mae.data.folder import LabeledFolder
    from tests.conftest import make_images, make_labeled

    make_images(tmp_path / "nested", n=12)  # a0/b0, a0/b1, a1/b0, ...: an unlabeled photo tree
    with pytest.raises(DataError, match="unlabeled nested folder"):
        LabeledFolder(tmp_path / "nested")
    loose = make_labeled(tmp_path / "loose", per_class=2)
    Image.new("RGB", (8, 8)).save(loose / "stray.png")
    with pytest.raises(DataError, match="outside any class subfolder"):
        LabeledFolder(loose)
    deep = make_labeled(tmp_path / "deep", per_class=2)
    for name in ("red", "green", "blue"):  # classes with their own nesting below them still work
        (deep / name / "more").mkdir()
        Image.new("RGB", (8, 8)).save(deep / name / "more" / "x.png")
    assert len(LabeledFolder(deep)) == 9


def test_a_seeded_sample_leaves_the_global_generators_going_on_from_where_they_were(tmp_path):
    """A fine-tuning sample (RandAugment, random erasing: torch, `random` and NumPy draws) depends on
    (seed, epoch, index) only; afterwards torch's generator is as it was and `random`/NumPy continue as
    a function of their earlier state, not of the sample's seed."""
    import random

    from mae.data.folder import LabeledFolder
    from mae.data.labeled import LabeledSamples
    from tests.conftest import make_labeled

    make_labeled(tmp_path, per_class=2, size=40)
    a = AugmentConfig()
    tf = train_transform((32, 32), scale=a.crop_scale, mean=(0.5,) * 3, std=(0.5,) * 3, auto_augment=a.auto_augment,
                         re_prob=1.0)  # fmt: skip
    ds = LabeledSamples(LabeledFolder(tmp_path), tf, seed=3)

    def after(key, global_seed):
        torch.manual_seed(global_seed)
        random.seed(global_seed)
        np.random.seed(global_seed)
        x = ds[key]["image"]
        return x, (torch.rand(4), random.random(), np.random.rand())

    x1, g1 = after((0, 1), 5)
    x2, g2 = after((0, 1), 6)  # another global state: the same sample
    x3, g3 = after((1, 2), 5)  # another sample: the same global continuation
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(g1[0], g3[0]) and g1[1:] == g3[1:] and g1[1:] != g2[1:]
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), g1[0])  # torch's generator restored exactly


def test_a_labeled_dataset_takes_class_labels_integers_or_class_names(tmp_path):
    """A `datasets` table's label column: a ClassLabel (its names), integers (0..max), or class names as text
    (in name order, as class folders are), here beside a text column of image paths."""
    paths = []
    for i in range(4):
        paths.append(str(tmp_path / f"{i}.png"))
        _image(i).save(paths[-1])
    names = ["shirt", "boot", "shirt", "bag"]
    by_name = LabeledHF(datasets.Dataset.from_dict({"file": paths, "kind": names}), "file", "kind", "t")
    assert by_name.classes == ["bag", "boot", "shirt"] and by_name.labels.tolist() == [2, 1, 2, 0]
    assert np.array_equal(np.asarray(by_name.load(3)), np.asarray(_image(3)))
    numbers = LabeledHF(datasets.Dataset.from_dict({"file": paths, "label": [0, 2, 2, 1]}), "file", None, "t")
    assert numbers.classes == ["0", "1", "2"] and numbers.labels.tolist() == [0, 2, 2, 1]
    features = datasets.Features({"file": datasets.Value("string"), "y": datasets.ClassLabel(names=["x", "y", "z"])})
    tagged = LabeledHF(
        datasets.Dataset.from_dict({"file": paths, "y": [2, 0, 1, 1]}, features=features), "file", None, "t"
    )
    assert tagged.classes == ["x", "y", "z"] and tagged.labels.tolist() == [2, 0, 1, 1]
    with pytest.raises(DataError, match="label -1 of row 1 is outside"):
        LabeledHF(datasets.Dataset.from_dict({"file": paths, "label": [0, -1, 1, 1]}), "file", None, "t")
