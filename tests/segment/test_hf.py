"""`datasets` sources for `mae segment`: a `save_to_disk` folder (or the object) is the folder it was made from, bit
for bit, through training, evaluation and `mae predict`; its masks are checked as a folder's are, each bad one
stopping the run with one line naming its row and column; and the mask column is picked as documented."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

import mae
from mae.data.segmentation import SegmentationFolder, open_segmentation
from mae.data.segmentation_hf import SegmentationHF, find_mask_columns
from mae.errors import DataError, one_line
from tests.segment.helpers import make_segmentation
from tests.train.test_reliability import assert_same_tensors

LOOP = {"batch_size": 4, "progress": False, "mixed_precision": "no", "log_every": 1, "epochs": 2}
TIMING = ("img_per_s", "data_wait")


def stored_images(root) -> list[dict]:
    """The image files of a segmentation folder as `datasets` stores them (their bytes), in the folder's order."""
    return [{"bytes": p.read_bytes(), "path": None} for p in sorted((root / "images").iterdir())]


def as_dataset(root, mask_column: str = "annotation") -> datasets.Dataset:
    """A segmentation folder as a `datasets.Dataset`: its image and mask files' bytes, in the folder's order."""
    masks = [
        {"bytes": (root / "masks" / p.name).read_bytes(), "path": None} for p in sorted((root / "images").iterdir())
    ]
    stored = {"image": stored_images(root), mask_column: masks}
    features = datasets.Features({"image": datasets.Image(), mask_column: datasets.Image()})
    return datasets.Dataset.from_dict(stored, features=features)


def saved(root, mask_column: str = "annotation"):
    path = root.parent / f"{root.name}_saved"
    as_dataset(root, mask_column).save_to_disk(str(path))
    return path


def metrics(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in lines]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same fine-tuning run on a folder and on its `datasets` twin (a save_to_disk training set, the validation
    set as an object), 2 epochs of 3 steps."""
    root = tmp_path_factory.mktemp("hfseg")
    train, val = make_segmentation(root / "train", n=12, seed=1), make_segmentation(root / "val", n=5, seed=2)
    args = dict(pretrained="random:mae_vit_micro_patch8", head="progressive", model={"img_size": 32},
                loop=LOOP, optim={"warmup_epochs": 1, "lr": 1e-3})  # fmt: skip
    folder = mae.segment(**args, data={"path": str(train), "val_path": str(val), "num_workers": 0},
                         output_dir=root / "folder")  # fmt: skip
    hf = mae.segment(**args, data={"path": str(saved(train)), "val_path": as_dataset(val), "num_workers": 0},
                     output_dir=root / "hf")  # fmt: skip
    return root, folder, hf


def test_a_saved_dataset_trains_and_scores_exactly_as_its_folder(runs):
    root, folder, hf = runs
    lines = metrics(root / "folder")
    assert [x for x in lines if "eval" in x] and lines == metrics(root / "hf")  # losses, mIoU, per-class IoU
    assert hf.metrics == folder.metrics and "miou" in hf.metrics
    assert_same_tensors(*(load_file(root / d / "segmenter.safetensors") for d in ("folder", "hf")))
    recorded = (root / "hf" / "config.yaml").read_text()
    assert "train_saved" in recorded and "datasets.Dataset(fingerprint=" in recorded  # the object's stand-in


def test_predict_on_a_dataset_writes_the_folders_masks_named_by_row(runs):
    root, folder, _ = runs
    common = dict(pretrained=folder.output_dir, loop={"batch_size": 4})
    mae.predict(**common, data={"path": str(root / "val"), "num_workers": 0}, output_dir=root / "p_folder")
    mae.predict(**common, data={"path": str(saved(root / "val")), "num_workers": 0}, output_dir=root / "p_hf")
    by_file = sorted((root / "p_folder").glob("s*.png"))
    by_row = sorted((root / "p_hf").glob("0*.png"))
    assert [p.name for p in by_row] == [f"{i:06d}.png" for i in range(5)] and len(by_file) == 5
    for a, b in zip(by_file, by_row, strict=True):
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


def test_predict_segments_the_images_of_a_dataset_that_lists_its_masks_first(runs):
    """The masks' column comes first (an Image column like the images'): predict still segments the images."""
    root, folder, _ = runs
    first = as_dataset(root / "val", "mask").select_columns(["mask", "image"])
    assert list(first.features) == ["mask", "image"]
    common = dict(pretrained=folder.output_dir, loop={"batch_size": 4})
    mae.predict(**common, data={"path": str(root / "val"), "num_workers": 0}, output_dir=root / "q_folder")
    mae.predict(**common, data={"path": first, "num_workers": 0}, output_dir=root / "q_first")
    by_file, by_row = sorted((root / "q_folder").glob("s*.png")), sorted((root / "q_first").glob("0*.png"))
    assert len(by_file) == len(by_row) == 5
    for a, b in zip(by_file, by_row, strict=True):
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


def test_masks_read_as_the_folders_palette_arrays_and_classlabel_names(tmp_path):
    root = make_segmentation(tmp_path / "d", n=4, classes=3, seed=5, palette=True)
    folder, hf = SegmentationFolder(root), SegmentationHF(as_dataset(root, "mask"), image_column=None,
                                                         mask_column=None, label="d")  # fmt: skip
    assert hf.palette == folder.palette and hf.classes == folder.classes and len(hf) == 4
    for i in range(4):
        assert np.array_equal(hf.load_mask(i), folder.load_mask(i))
        assert np.array_equal(np.asarray(hf.load(i)), np.asarray(folder.load(i)))
    names = datasets.Sequence(datasets.Sequence(datasets.ClassLabel(names=["sky", "red", "green"])))
    arrays = datasets.Dataset.from_dict(
        {"image": stored_images(root), "label": [folder.load_mask(i).tolist() for i in range(4)]},
        features=datasets.Features({"image": datasets.Image(), "label": names}),
    )
    source = SegmentationHF(arrays, image_column=None, mask_column=None, label="arrays")
    assert source.classes == ["sky", "red", "green"] and source.named and not hf.named
    assert all(np.array_equal(source.load_mask(i), folder.load_mask(i)) for i in range(4))
    part = source.subset(np.array([3, 1]))
    assert np.array_equal(part.load_mask(0), folder.load_mask(3)) and part.name(1) == "arrays[1] column 'image'"


def _bad(root, case: str) -> tuple[datasets.Dataset, dict, str]:
    """The folder as a dataset with row 1's mask made bad, the options, and the line expected."""
    where = r"<datasets.Dataset>\[1\] column 'annotation'"
    images = stored_images(root)
    masks = [np.asarray(Image.open(p), np.int64) for p in sorted((root / "masks").iterdir())]
    if case == "classlabel":  # arrays of ClassLabel values, one of them datasets' "no label" (-1)
        masks[1][0, 0] = -1
        names = datasets.Sequence(datasets.Sequence(datasets.ClassLabel(names=["background", "object"])))
        features = datasets.Features({"image": datasets.Image(), "annotation": names})
        ds = datasets.Dataset.from_dict({"image": images, "annotation": [m.tolist() for m in masks]}, features)
        return ds, {}, rf"^{where}: class index -1; indices run from 0 and 255 marks the pixels to ignore; fix "
    values: list = [Image.fromarray(m.astype(np.uint8)) for m in masks]
    values[1] = {"size": Image.new("L", (32, 20)), "index": Image.fromarray(np.full((32, 32), 7, np.uint8)),
                 "missing": None, "rgb": Image.new("RGB", (32, 32))}[case]  # fmt: skip
    features = datasets.Features({"image": datasets.Image(), "annotation": datasets.Image()})
    ds = datasets.Dataset.from_dict({"image": images, "annotation": values}, features)
    expected = {
        "size": rf"^{where}: mask is 32x20 \(WxH\) but its image <datasets.Dataset>\[1\] column 'image' is 32x32; ",
        "index": rf"^{where}: class index 7 but --data.num_classes is 2 \(0 to 1; 255 = ignore\); fix the mask",
        "missing": rf"^{where}: no mask \(None\); every row needs one: fill it, or drop the row",
        "rgb": rf"^{where}: a mask must hold one class index per pixel .* not mode RGB",
    }[case]
    return ds, {"num_classes": 2} if case == "index" else {}, expected


@pytest.mark.parametrize("case", ["size", "index", "missing", "rgb", "classlabel"])
def test_every_bad_mask_gives_one_line_naming_its_row_and_column(tmp_path, case):
    ds, options, expected = _bad(make_segmentation(tmp_path / "d", n=3), case)
    with pytest.raises(DataError, match=expected) as e:
        open_segmentation(ds, option="--data.path", **{"num_classes": None, **options})
    assert "\n" not in str(e.value) and str(e.value) == one_line(e.value)


def _features(**columns) -> datasets.Features:
    kinds = {"img": datasets.Image(), "cls": datasets.ClassLabel(names=["a", "b"]), "txt": datasets.Value("string")}
    return datasets.Features({name: kinds[kind] for name, kind in columns.items()})


@pytest.mark.parametrize(
    ("columns", "image", "mask"),
    [
        (dict(image="img", annotation="img", scene_category="cls"), "image", "annotation"),  # scene_parse_150
        (dict(pixel_values="img", label="img"), "pixel_values", "label"),  # segments/sidewalk-semantic
        (dict(annotation="img", image="img"), "image", "annotation"),  # the masks first: still the masks
        (dict(label="cls", photo="img", seg="img"), "photo", "seg"),  # a class label is no mask: the other Image
        (dict(image="img", mask="txt"), "image", "mask"),  # mask file paths
    ],
)
def test_the_mask_column_by_name_else_the_other_image_column(columns, image, mask):
    assert find_mask_columns(_features(**columns), None, None, "d") == (image, mask)


@pytest.mark.parametrize(
    ("columns", "given", "expected"),
    [
        (dict(image="img", mask="img"), ("image", "masks"), r"--data.mask_column masks: not in d \(columns: "),
        (dict(image="img", label="cls"), (None, None), r"d: no mask column \(columns: \['image', 'label'\]\); set "),
        (dict(image="img", label="cls"), (None, "label"), r"--data.mask_column label: holds ClassLabel\(.*\), not "),
        (dict(image="img", mask="img"), ("mask", "mask"), r"--data.mask_column mask: also --data.image_column; "),
        (dict(a="img", b="img"), ("c", None), r"--data.image_column c: not in d \(columns: \['a', 'b'\]\)"),
    ],
)
def test_the_column_options_errors(columns, given, expected):
    with pytest.raises(DataError, match="^" + expected):
        find_mask_columns(_features(**columns), *given, "d")


def test_the_options_reach_the_dataset(tmp_path):
    path = saved(make_segmentation(tmp_path / "d", n=3), mask_column="seg")
    run = dict(pretrained="random:mae_vit_micro_patch8", loop=LOOP)
    with pytest.raises(mae.MaeError, match=rf"^--data.mask_column masks: not in {path} \(columns: \['image', 'seg'"):
        mae.segment(**run, data={"path": str(path), "mask_column": "masks"}, output_dir=tmp_path / "a")
    stand_in = "datasets.Dataset(fingerprint=x, num_rows=3)"  # what config.yaml records of an object
    with pytest.raises(mae.MaeError, match=r"^--data.val_path datasets.Dataset\(fingerprint=x, num_rows=3\): a "):
        mae.segment(**run, data={"path": str(path), "val_path": stand_in}, output_dir=tmp_path / "b")
