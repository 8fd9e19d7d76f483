import torch
from PIL import Image

from mae.data.samplers import EpochSampler
from mae.data.sources import FolderSource
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
