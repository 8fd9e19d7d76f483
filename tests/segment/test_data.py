"""Segmentation folders: masks read as indices (grayscale or palette), every bad mask stops with one line naming
its file, and the training augmentations move the image and its mask together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mae.data.segment_transforms import JointTrainTransform
from mae.data.segmentation import SegmentationFolder, SegmentationSamples, split_segmentation
from mae.errors import DataError, one_line
from tests.segment.helpers import make_segmentation


def test_palette_masks_read_as_their_indices_and_classes_txt_names_the_classes(tmp_path):
    grey = SegmentationFolder(make_segmentation(tmp_path / "grey", n=4, classes=3, seed=5))
    pal = SegmentationFolder(make_segmentation(tmp_path / "pal", n=4, classes=3, seed=5, palette=True,
                                               names=["sky", "red", "green"]))  # fmt: skip
    assert Image.open(pal.masks[0]).mode == "P"
    for i in range(4):
        assert np.array_equal(grey.load_mask(i), pal.load_mask(i))
    assert pal.classes == ["sky", "red", "green"]
    assert pal.palette[:6] == [0, 0, 0, 255, 0, 0]  # the masks' own colours, kept for the outputs
    assert grey.classes == [str(i) for i in range(int(max(grey.load_mask(i).max() for i in range(4))) + 1)]
    train, val = split_segmentation(grey, 0.25, seed=0)
    assert len(train) == 3 and len(val) == 1 and set(train.masks).isdisjoint(val.masks)
    assert train.classes == val.classes == grey.classes


def _bad(root, case):
    mask = root / "masks" / "s001.png"
    if case == "size":
        Image.fromarray(np.zeros((20, 32), np.uint8)).save(mask)
        return rf"^{mask}: mask is 32x20 \(WxH\) but its image .*s001.png is 32x32; masks must match"
    if case == "index":
        a = np.asarray(Image.open(mask)).copy()
        a[0, 0] = 7
        Image.fromarray(a).save(mask)
        return rf"^{mask}: class index 7 but classes.txt names 2 \(0 to 1; 255 = ignore\)"
    if case == "missing":
        mask.unlink()
        return rf"^{root / 'images' / 's001.png'}: no mask {mask}; every image needs masks/<same name>.png"
    Image.new("RGB", (32, 32)).save(mask)  # a colour picture, not indices
    return rf"^{mask}: a mask must hold one class index per pixel .* not mode RGB"


@pytest.mark.parametrize("case", ["size", "index", "missing", "rgb"])
def test_every_bad_mask_gives_one_line_naming_its_file(tmp_path, case):
    root = make_segmentation(tmp_path / "d", n=3, names=["background", "object"])
    expected = _bad(root, case)
    with pytest.raises(DataError, match=expected) as e:
        SegmentationFolder(root)
    assert "\n" not in one_line(e.value) and str(e.value) == one_line(e.value)


def test_the_ignore_index_is_not_a_class_and_num_classes_bounds_the_indices(tmp_path):
    root = make_segmentation(tmp_path / "d", n=3)
    a = np.asarray(Image.open(root / "masks" / "s000.png")).copy()
    a[:4] = 255
    Image.fromarray(a).save(root / "masks" / "s000.png")
    assert SegmentationFolder(root).classes == ["0", "1"]
    with pytest.raises(DataError, match=r"class index 1 but --data.num_classes is 1"):
        SegmentationFolder(root, num_classes=1)


def interior(mask: torch.Tensor) -> torch.Tensor:
    """Pixels whose 7x7 neighbourhood holds one class (resampling blends the image, not the mask, at edges)."""
    m = mask[None, None].float()
    high = torch.nn.functional.max_pool2d(m, 7, 1, 3)
    low = -torch.nn.functional.max_pool2d(-m, 7, 1, 3)
    inside = (high == low)[0, 0]
    inside[:3], inside[-3:], inside[:, :3], inside[:, -3:] = False, False, False, False  # edges cut by the crop
    return inside


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])  # the input square or not
def test_image_and_mask_move_together_under_every_augmentation(tmp_path, size):
    """The mask is a function of the image's content (red rectangles = class 1), on a non-square image: after any
    rescale, crop, pad and flip the mask must still say where the red is."""
    root = make_segmentation(tmp_path / "d", n=6, size=(36, 52), seed=3)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    samples = SegmentationSamples(SegmentationFolder(root), JointTrainTransform(size, mean=mean, std=std), seed=1)
    flips = crops = 0
    for epoch in range(4):
        for i in range(len(samples)):
            s = samples[(epoch, i)]
            image, mask = s["image"] * 0.25 + 0.5, s["mask"]
            assert image.shape == (3, *size) and mask.shape == size and mask.dtype == torch.int64
            labeled = mask != 255
            red = (image[0] > 0.8) & (image[1] < 0.55)  # the rectangles: R 255, G 110 over a dark texture
            agree = (red == (mask == 1))[interior(mask) & labeled].float().mean().item()
            assert agree > 0.99, (epoch, i, agree)  # an image moved without its mask: ~0.7
            assert (mask[~labeled] == 255).all() and (image[:, ~labeled].abs() < 1e-6 + 0.5).all()  # pad = mean
            again = samples[(epoch, i)]
            assert torch.equal(again["image"], s["image"]) and torch.equal(again["mask"], mask)  # seeded
            flips += int(not torch.equal(samples[(epoch + 10, i)]["mask"], mask))
            crops += 1
    assert flips > crops // 2  # the draws differ from epoch to epoch


def test_images_of_any_channel_count(tmp_path):
    root = make_segmentation(tmp_path / "d", n=2, size=(16, 24))
    for p in (root / "images").iterdir():
        rgb = np.asarray(Image.open(p), np.float32) / 255
        np.save(p.with_suffix(".npy"), np.concatenate([rgb, rgb[..., :1]], axis=2))  # 4 bands
        p.unlink()
    source = SegmentationFolder(root)
    tf = JointTrainTransform((16, 16), mean=(0.5,) * 4, std=(0.5,) * 4)
    s = SegmentationSamples(source, tf, in_chans=4)[(0, 1)]
    assert s["image"].shape == (4, 16, 16) and s["mask"].shape == (16, 16)
