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


def test_the_rescale_just_covers_the_input_then_crops_it():
    """With the factor fixed at 1 the image is resized (bilinear, antialiased, pixel centres on pixel centres) to
    just cover the input, then cropped: its content is the resized image's, normalised per channel."""
    from mae.data.segment_transforms import cover_scale, resize_pair

    assert cover_scale((24, 40), 36, 52) == 40 / 52 and cover_scale((24, 40), 20, 80) == 24 / 20
    image = torch.rand(3, 36, 52, generator=torch.Generator().manual_seed(0))
    mask = torch.randint(0, 3, (36, 52), generator=torch.Generator().manual_seed(1))
    mean, std = (0.5, 0.25, 0.125), (0.5, 0.25, 2.0)
    tf = JointTrainTransform((24, 40), mean=mean, std=std, scale=(1.0, 1.0), hflip=0.0)
    out, out_mask = tf(image, mask, torch.Generator().manual_seed(2))
    resized, resized_mask = resize_pair(image, mask, (28, 40))  # 36 x 40/52 = 27.7 rows, 40 columns
    assert resized.shape == (3, 28, 40) and resized_mask.shape == (28, 40)
    denormalised = out * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    tops = [t for t in range(5) if torch.allclose(denormalised, resized[:, t : t + 24], atol=1e-6)]
    assert len(tops) == 1 and torch.equal(out_mask, resized_mask[tops[0] : tops[0] + 24])


def test_resizing_antialiases_keeps_pixel_centres_and_picks_mask_indices():
    from mae.data.segment_transforms import resize_pair

    ramp = torch.arange(16.0).expand(3, 8, 16)  # value = column
    half, _ = resize_pair(ramp, None, (4, 8))
    assert torch.allclose(half[:, :, 1:-1], torch.arange(1, 7) * 2 + 0.5)  # output centre i sits on 2i + 0.5
    one_in_four = (torch.arange(32) % 4 == 0).float().expand(1, 4, 32)
    flat, _ = resize_pair(one_in_four, None, (4, 8))  # detail finer than the output's pixels averages out
    assert torch.allclose(flat[:, :, 1:-1], torch.full((1, 4, 6), 0.25), atol=0.02)
    mask = torch.tensor([[0, 1, 2, 3]]).repeat(4, 1)
    same_image, same_mask = resize_pair(ramp[:, :4, :4], mask, (4, 4))
    assert same_image is not None and torch.equal(same_mask, mask) and torch.equal(same_image, ramp[:, :4, :4])
    wide = resize_pair(ramp[:, :4, :4], mask, (2, 8))[1]
    assert wide.dtype == torch.int64 and wide.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2


@pytest.mark.parametrize(
    ("size", "image_hw", "labeled"),
    [((24, 40), (36, 104), (22, 62)), ((24, 40), (30, 30), (36, 36)), ((2, 2), (4, 4), (1, 1))],
)
def test_a_smaller_rescale_is_padded_at_the_bottom_and_right_with_the_ignore_index(size, image_hw, labeled):
    """The factor 0.9 of the cover (0.5 x 0.5 for the 2x2 input): rows or columns short of the input are padded with
    the mean (0 after normalising) and the ignore index, and the crop cannot move along a padded side."""
    scale = (0.25, 0.25) if size == (2, 2) else (0.9, 0.9)
    tf = JointTrainTransform(size, mean=(0.0,) * 3, std=(1.0,) * 3, scale=scale, hflip=0.0)
    image, mask = torch.rand(3, *image_hw) + 0.5, torch.zeros(image_hw, dtype=torch.int64)
    for seed in range(4):
        out, out_mask = tf(image, mask, torch.Generator().manual_seed(seed))
        assert out.shape == (3, *size) and out_mask.shape == size
        rows, cols = min(labeled[0], size[0]), min(labeled[1], size[1])
        assert (out_mask[:rows, :cols] == 0).all() and (out[:, :rows, :cols] > 0.4).all()
        assert (out_mask[rows:] == 255).all() and (out_mask[:, cols:] == 255).all()
        assert (out[:, rows:] == 0).all() and (out[:, :, cols:] == 0).all()


def test_the_default_draws_rescale_half_to_twice_the_cover_and_flip_half_the_images():
    """mmsegmentation's ratio range (0.5, 2.0) and flip probability 0.5: on an input-sized image a factor under 1
    pads (a third of the draws, down to half the rows), and a flip mirrors the mask."""
    mask = torch.arange(32).repeat(32, 1)  # the column index
    image = torch.rand(3, 32, 32)
    g = torch.Generator().manual_seed(0)
    padded = torch.tensor([(tf_mask == 255).any().item() for tf_mask in (
        JointTrainTransform((32, 32), mean=(0.0,) * 3, std=(1.0,) * 3, hflip=0.0)(image, mask, g)[1]
        for _ in range(300)
    )])  # fmt: skip
    assert 0.25 < padded.float().mean() < 0.42
    fewest = min((m[:, 0] != 255).sum().item() for m in (  # labeled rows; a padded draw starts at column 0
        JointTrainTransform((32, 32), mean=(0.0,) * 3, std=(1.0,) * 3, hflip=0.0)(image, mask, g)[1]
        for _ in range(300)
    ))  # fmt: skip
    assert 0 < fewest <= 18
    flip = JointTrainTransform((32, 32), mean=(0.0,) * 3, std=(1.0,) * 3, scale=(1.0, 1.0))
    outs = [flip(image, mask, g) for _ in range(300)]
    flipped = [torch.equal(m, mask.flip(-1)) and torch.equal(im, image.flip(-1)) for im, m in outs]
    assert all(f or (torch.equal(m, mask) and torch.equal(im, image)) for f, (im, m) in zip(flipped, outs, strict=True))
    assert 0.4 < sum(flipped) / 300 < 0.6


def test_evaluation_normalises_each_channel_and_keeps_the_mask():
    from mae.data.segment_transforms import JointEvalTransform

    image, mask = torch.rand(3, 5, 7), torch.randint(0, 4, (5, 7))
    out, out_mask = JointEvalTransform(mean=(0.5, 0.25, 0.125), std=(0.5, 0.25, 2.0))(image, mask)
    expected = torch.stack([(image[0] - 0.5) / 0.5, (image[1] - 0.25) / 0.25, (image[2] - 0.125) / 2.0])
    assert torch.allclose(out, expected) and out_mask is mask


def test_hflip_is_the_chance_of_a_flip_at_either_end_of_the_draws(monkeypatch):
    """A uniform draw in [0, 1) flips when it falls below `hflip`: with hflip 0 not even a draw of 0 flips."""
    image, mask = torch.rand(3, 8, 8), torch.arange(8).repeat(8, 1)
    lowest = torch.zeros(())
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: lowest)
    never = JointTrainTransform((8, 8), mean=(0.0,) * 3, std=(1.0,) * 3, scale=(1.0, 1.0), hflip=0.0)
    always = JointTrainTransform((8, 8), mean=(0.0,) * 3, std=(1.0,) * 3, scale=(1.0, 1.0), hflip=1.0)
    assert torch.equal(never(image, mask, torch.Generator())[1], mask)
    assert torch.equal(always(image, mask, torch.Generator())[1], mask.flip(-1))
