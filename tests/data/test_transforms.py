import torch
from PIL import Image

from mae.data.base import BaseSource
from mae.data.folder import FolderSource
from mae.data.samplers import EpochSampler
from mae.data.transforms import PretrainSamples, collate_samples
from tests.conftest import make_images


def _samples(root, seed=0):
    return PretrainSamples(FolderSource(root), img_size=(32, 32), patch_size=8, seed=seed)


def test_sample_depends_only_on_seed_epoch_index(image_folder):
    ds = _samples(image_folder)
    torch.manual_seed(1)
    a = ds[(3, 5)]
    torch.manual_seed(2)
    b = _samples(image_folder)[(3, 5)]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["noise"], b["noise"])
    assert a["image"].dtype == torch.uint8 and a["image"].shape == (3, 32, 32) and a["noise"].shape == (16,)
    c = ds[(4, 5)]
    assert not torch.equal(a["noise"], c["noise"])
    assert not torch.equal(a["noise"], _samples(image_folder, seed=1)[(3, 5)]["noise"])


def test_sample_does_not_disturb_global_rng(image_folder):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    _samples(image_folder)[(0, 0)]
    assert torch.equal(torch.rand(3), expected)


def test_broken_files_are_reported_with_the_batch(tmp_path):
    make_images(tmp_path, n=3, nested=False)
    (tmp_path / "broken.jpg").write_bytes(b"this is text, not a JPEG")
    good = next(tmp_path.glob("*.png"))
    (tmp_path / "truncated.png").write_bytes(good.read_bytes()[:60])
    ds = _samples(tmp_path)
    batch = collate_samples([ds[(0, i)] for i in range(len(ds))])
    assert len(batch["image"]) == 3
    bad = dict(batch["bad"])
    assert set(map(lambda p: p.rsplit("/", 1)[-1], bad)) == {"broken.jpg", "truncated.png"}
    assert all(reason for reason in bad.values())


def test_epoch_sampler_order_depends_on_seed_and_epoch():
    s = EpochSampler(10, seed=3)
    s.set_epoch(2)
    first = list(s)
    assert sorted(i for _, i in first) == list(range(10)) and {e for e, _ in first} == {2}
    assert list(s) == first
    s.set_epoch(3)
    assert [i for _, i in s] != [i for _, i in first]


def test_decompression_bomb_is_skipped(tmp_path):
    Image.new("L", (10, 10)).save(tmp_path / "ok.png")
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 20  # 100 pixels > 2 x 20: PIL refuses it as a bomb
    try:
        name, reason = _samples(tmp_path)[(0, 0)]["bad"]
    finally:
        Image.MAX_IMAGE_PIXELS = old
    assert name.endswith("ok.png") and "DecompressionBomb" in reason


class _Counting(BaseSource):
    """A source that counts its decodes."""

    def __init__(self, source):
        self.source, self.decodes = source, 0
        self.labels = getattr(source, "labels", None)

    def __len__(self):
        return len(self.source)

    def name(self, i):
        return self.source.name(i)

    def load(self, i):
        self.decodes += 1
        return self.source.load(i)

    def load_array(self, i):
        self.decodes += 1
        return self.source.load_array(i)


def test_a_small_set_is_decoded_once_and_samples_stay_what_they_were(tmp_path):
    from mae.data.folder import LabeledFolder
    from mae.data.labeled import LabeledSamples
    from mae.data.transforms import train_transform
    from tests.conftest import make_labeled

    make_images(tmp_path / "imgs", n=6, size=24)
    make_labeled(tmp_path / "labeled", per_class=2, size=24)
    for in_chans in (3, 1):
        if in_chans == 1:  # the same files as grayscale
            for f in tmp_path.rglob("*.*"):
                Image.open(f).convert("L").save(f)
        src = _Counting(FolderSource(tmp_path / "imgs"))
        kept = PretrainSamples(src, img_size=(16, 16), patch_size=4, seed=0, in_chans=in_chans)
        fresh = PretrainSamples(FolderSource(tmp_path / "imgs"), img_size=(16, 16), patch_size=4, seed=0,
                                in_chans=in_chans)  # fmt: skip
        fresh.load.budget = 0  # decodes every time, as before
        for key in [(e, i) for e in range(3) for i in range(6)]:
            a, b = kept[key], fresh[key]
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["noise"], b["noise"])
        assert src.decodes == 6 and fresh.load.images is None

        # fine-tuning's augmentation (random erasing works in place) must not reach the kept images
        lsrc = _Counting(LabeledFolder(tmp_path / "labeled"))
        tf = train_transform((16, 16), scale=(0.5, 1.0), mean=(0.5,) * in_chans, std=(0.5,) * in_chans, re_prob=1.0,
                             in_chans=in_chans)  # fmt: skip
        kept, fresh = (
            LabeledSamples(lsrc, tf, seed=0, in_chans=in_chans),
            LabeledSamples(LabeledFolder(tmp_path / "labeled"), tf, seed=0, in_chans=in_chans),
        )
        fresh.load.budget = 0
        for key in [(e, i) for e in range(3) for i in range(len(lsrc))]:
            assert torch.equal(kept[key]["image"], fresh[key]["image"])
        assert lsrc.decodes == len(lsrc)


def test_a_set_too_large_for_the_budget_is_decoded_every_time(image_folder):
    ds = PretrainSamples(_Counting(FolderSource(image_folder)), img_size=(32, 32), patch_size=8, seed=0)
    ds.load.budget = 40 * 40 * 3 * (len(ds) - 1)  # one image short of the whole set (40-px RGB images)
    for epoch in range(2):
        for i in range(len(ds)):
            ds[(epoch, i)]
    assert ds.load.images is None and ds.source.decodes == 2 * len(ds)


def test_sample_seed_is_numpys_seed_sequence():
    """The plain-Python hash gives what `np.random.SeedSequence` gives, words past 32 bits included."""
    import random

    import numpy as np

    from mae.data.transforms import sample_seed

    rng = random.Random(0)
    values = [0, 1, 2**32 - 1, 2**32, 2**64 + 5]
    for _ in range(300):
        key = [rng.choice(values + [rng.randrange(2**31), rng.randrange(2**80)]) for _ in range(3)]
        expected = int(np.random.SeedSequence(key).generate_state(2, np.uint64)[0] >> 1)
        assert sample_seed(*key) == expected, key


def test_samples_are_torchvisions_crop_flip_and_mask(tmp_path):
    """Each sample is what torchvision's RandomResizedCrop.get_params, resized_crop and a flip give under the
    sample's seed (the private generator draws what the global one drew), for PIL and float images."""
    from torchvision.transforms import InterpolationMode, RandomResizedCrop
    from torchvision.transforms.v2 import functional as F

    from mae.data.transforms import crop_params, load_image, sample_seed

    make_images(tmp_path / "rgb", n=4, size=30)
    make_images(tmp_path / "gray", n=4, size=30)
    for f in (tmp_path / "gray").rglob("*.*"):
        Image.open(f).convert("L").save(f)
    for folder, in_chans, scale in (("rgb", 3, (0.2, 1.0)), ("gray", 1, (0.4, 1.0)), ("gray", 1, (1.0, 1.0))):
        src = FolderSource(tmp_path / folder)
        ds = PretrainSamples(src, img_size=(16, 16), patch_size=4, seed=7, crop_scale=scale, in_chans=in_chans)
        for epoch, index in [(e, i) for e in range(3) for i in range(4)]:
            img, _ = load_image(src, index, in_chans)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed(7, epoch, index))
                box = RandomResizedCrop.get_params(img, scale=list(scale), ratio=[3 / 4, 4 / 3])
                flip = torch.rand(()) < 0.5
                noise = torch.rand(16)
            x = F.resized_crop(img, *box, [16, 16], interpolation=InterpolationMode.BICUBIC, antialias=True)
            x = F.horizontal_flip(x) if flip else x
            x = x if in_chans == 1 else F.pil_to_tensor(x)
            sample = ds[(epoch, index)]
            assert torch.equal(sample["image"], x) and torch.equal(sample["noise"], noise)
    # the fallback (no draw fits in 10 tries): the central crop torchvision takes
    for size in ((100, 10), (10, 100), (40, 40)):
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                expected = RandomResizedCrop.get_params(torch.zeros(1, *size), scale=[0.9, 1.0], ratio=[3 / 4, 4 / 3])
            assert crop_params(size, (0.9, 1.0), (3 / 4, 4 / 3), g) == expected


def test_a_negative_seed_part_is_one_line():
    import pytest

    from mae.data.transforms import sample_seed

    with pytest.raises(ValueError, match=r"^sample_seed takes non-negative integers, got -3$"):
        sample_seed(0, -3, 1)


def test_crops_of_tiny_images_and_small_areas_are_torchvisions():
    """Draws that round a side to 0 or 1 pixel are refused or kept as torchvision's get_params does."""
    from torchvision.transforms import RandomResizedCrop

    from mae.data.transforms import crop_params

    for size, scale in [
        (size, scale) for size in ((1, 6), (6, 1), (2, 2), (3, 5), (9, 2)) for scale in ((0.02, 0.3), (0.02, 0.1))
    ]:
        for seed in range(40):
            g = torch.Generator().manual_seed(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                expected = RandomResizedCrop.get_params(torch.zeros(1, *size), scale=list(scale), ratio=[3 / 4, 4 / 3])
            assert crop_params(size, scale, (3 / 4, 4 / 3), g) == expected, (size, scale, seed)


class _Fixed(BaseSource):
    """`count` images (or an error) from a function of the index, for the decoding budget and the failure report."""

    def __init__(self, count, make):
        self.count, self.make, self.decodes = count, make, 0

    def __len__(self):
        return self.count

    def name(self, i):
        return f"img{i}"

    def load(self, i):
        self.decodes += 1
        return self.make(i)

    def load_array(self, i):
        import numpy as np

        self.decodes += 1
        return np.asarray(self.make(i), dtype=np.float32)[..., None] / 255


def test_the_decoded_images_budget_to_the_byte():
    """A set kept whole where it fits the budget exactly (256 MiB by default, judged from the first image), refused
    one byte over; images larger than the first kept only while the bytes used stay within the budget; float
    images counted at 4 bytes a value."""
    from mae.data.transforms import DecodedImages

    tiny = _Fixed(256 * 2**20, lambda i: Image.new("L", (1, 1)))  # one byte each: the default budget exactly
    assert DecodedImages(tiny, 3)(0)[1] is None and DecodedImages(tiny, 3).budget == 256 * 2**20
    kept = DecodedImages(tiny, 3)
    kept(0)
    assert kept.images is not None and kept.used == 1
    over = DecodedImages(_Fixed(256 * 2**20 + 1, lambda i: Image.new("L", (1, 1))), 3)
    over(0)
    assert over.images is None
    sides = [2, 2, 3, 4, 2]  # 4, 4, 9, 16, 4 bytes of grayscale
    growing = _Fixed(5, lambda i: Image.new("L", (sides[i], sides[i])))
    load = DecodedImages(growing, 3, budget=20)  # the first image says 5 x 4 = 20 bytes: fits
    for i in range(5):
        load(i)
    assert sorted(load.images) == [0, 1, 2] and load.used == 17  # 16 more would pass 20; 4 more too
    exact = DecodedImages(_Fixed(3, lambda i: Image.new("L", (2, 2))), 3, budget=12)
    for i in range(3):
        exact(i)
    assert sorted(exact.images) == [0, 1, 2] and exact.used == 12
    floats = _Fixed(3, lambda i: Image.new("L", (2, 2)))  # 1 channel as float32: 16 bytes an image
    short = DecodedImages(floats, 1, budget=3 * 16 - 1)
    short(0)
    assert short.images is None
    whole = DecodedImages(floats, 1, budget=3 * 16)
    for i in range(3):
        whole(i)
    assert whole.used == 48 and len(whole.images) == 3


def test_an_undecodable_file_reports_the_first_line_of_its_error_cut_to_200_characters():
    from mae.data.transforms import load_image

    def fail(i):
        raise OSError("x" * 300 + "\nsecond line")

    assert load_image(_Fixed(1, fail), 0) == (None, {"bad": ("img0", ("OSError: " + "x" * 300)[:200])})
    img, bad = load_image(_Fixed(1, lambda i: Image.new("RGB", (3, 3))), 0)  # 3 channels by default: PIL RGB
    assert bad is None and isinstance(img, Image.Image) and img.mode == "RGB"


def test_the_smallest_crop_keeps_full_resolution_at_the_decode_side():
    """At the side `crop_decode_side` gives, the narrowest crop of the smallest area (aspect 3/4) spans at least the
    model's input; a side one pixel smaller would not."""
    import math

    from mae.data.transforms import crop_decode_side

    for size, scale in (((224, 224), 0.2), ((32, 48), 0.08), ((28, 28), 0.5)):
        side = crop_decode_side(size, scale)
        narrowest = [math.sqrt(scale * s * s * 3 / 4) for s in (side, side - 1)]  # the crop's short side, s x s
        assert narrowest[0] >= max(size) - 1e-9 and narrowest[1] < max(size)


def test_the_default_sample_crop_and_mask_ratio(tmp_path):
    """crop_scale (0.2, 1.0) and mask ratio 0.75 by default; the visible count from both grid sides."""
    from mae.models.masking import num_visible

    make_images(tmp_path, n=3, size=40, nested=False)
    bare = PretrainSamples(FolderSource(tmp_path), img_size=(16, 32), patch_size=8, seed=0, masking="block")
    explicit = PretrainSamples(FolderSource(tmp_path), img_size=(16, 32), patch_size=8, seed=0, masking="block",
                               crop_scale=(0.2, 1.0), mask_ratio=0.75)  # fmt: skip
    for key in [(0, i) for i in range(3)] + [(1, i) for i in range(3)]:
        a, b = bare[key], explicit[key]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["noise"], b["noise"])
        assert int((a["noise"] < 1).sum()) == num_visible(2 * 4, 0.75) == 2  # block masking ranks the kept first


def test_the_decode_size_allows_the_smallest_crop():
    from mae.data.transforms import crop_decode_side

    class Recording(_Fixed):
        def set_decode_size(self, side):
            self.side = side

    src = Recording(1, lambda i: Image.new("RGB", (4, 4)))
    PretrainSamples(src, img_size=(16, 16), patch_size=4, seed=0, crop_scale=(0.3, 0.9))
    assert src.side == crop_decode_side((16, 16), 0.3)
