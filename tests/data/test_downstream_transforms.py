"""The downstream stages' transforms (timm's, and the same steps on float tensors for other channel counts) against
torchvision step by step, their settings, posterize in every augment policy; collation and normalisation."""

import torch
from PIL import Image


def test_collated_images_and_denormalised_floats():
    from mae.data.transforms import collate_images, denormalize, normalize

    batch = collate_images([{"image": torch.ones(1, 2, 2), "index": 4}, {"bad": ("x.png", "OSError: no")}])
    assert batch.keys() == {"image", "index", "bad"} and batch["index"].tolist() == [4]
    assert batch["bad"] == [("x.png", "OSError: no")]
    x = torch.tensor([0.0, 0.5, 1.0]).view(1, 3, 1, 1)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    torch.testing.assert_close(denormalize(normalize(x, mean, std), mean, std), x)
    assert denormalize(torch.full((1, 3, 1, 1), 9.0), mean, std).flatten().tolist() == [1.0, 1.0, 1.0]  # clamped
    assert denormalize(torch.full((1, 3, 1, 1), -9.0), mean, std).flatten().tolist() == [0.0, 0.0, 0.0]


def test_the_eval_transform_resizes_by_crop_pct_then_centre_crops():
    """RGB (the default): timm's, i.e. torchvision's resize of the short side to size / crop_pct (bicubic), centre crop,
    normalise; another channel count: the same steps on float tensors, antialiased."""
    from torchvision.transforms import functional as TF
    from torchvision.transforms import v2

    from mae.data.transforms import eval_transform

    g = torch.Generator().manual_seed(0)
    rgb = Image.fromarray((torch.rand(80, 100, 3, generator=g) * 255).byte().numpy())
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.3, 0.4)
    got = eval_transform((32, 32), crop_pct=0.875, mean=mean, std=std)(rgb)
    small = TF.center_crop(TF.resize(rgb, 36, interpolation=TF.InterpolationMode.BICUBIC), [32, 32])
    torch.testing.assert_close(got, TF.normalize(TF.to_tensor(small), mean, std))
    gray = torch.rand(1, 80, 100, generator=g)
    got = eval_transform((32, 32), crop_pct=0.875, mean=(0.5,), std=(0.25,), in_chans=1)(gray)
    want = v2.functional.resize(gray, [36], interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    want = (v2.functional.center_crop(want, [32, 32]) - 0.5) / 0.25
    torch.testing.assert_close(got, want)


def test_the_train_transform_steps_and_their_settings():
    """RGB: timm's crop, a flip of chance 0.5, random erasing only when asked (once, in pixel mode); another channel
    count: the crop (antialiased), flip and normalisation on float tensors, RandAugment left out with a warning
    attributed to the caller."""
    import warnings

    from timm.data.random_erasing import RandomErasing
    from torchvision.transforms import v2

    from mae.data.transforms import train_transform

    kw = dict(scale=(0.3, 1.0), mean=(0.5,) * 3, std=(0.5,) * 3)
    bare = train_transform((32, 32), **kw).transforms
    assert not any(isinstance(t, RandomErasing) for t in bare)
    assert [t.p for t in bare if type(t).__name__ == "RandomHorizontalFlip"] == [0.5]
    erasing = [t for t in train_transform((32, 32), re_prob=0.3, **kw).transforms if isinstance(t, RandomErasing)]
    assert [(e.probability, e.max_count, e.mode) for e in erasing] == [(0.3, 1, "pixel")]
    gray_kw = dict(scale=(0.3, 1.0), mean=(0.5,), std=(0.25,), in_chans=1)
    assert not any(isinstance(t, RandomErasing) for t in train_transform((16, 16), re_prob=0.0, **gray_kw).transforms)
    erasing = [t for t in train_transform((16, 16), re_prob=0.5, **gray_kw).transforms if isinstance(t, RandomErasing)]
    assert [(e.probability, e.max_count, e.mode) for e in erasing] == [(0.5, 1, "pixel")]
    x = torch.rand(1, 60, 50, generator=torch.Generator().manual_seed(1))
    tf = train_transform((16, 16), **gray_kw)
    crop = v2.RandomResizedCrop([16, 16], scale=(0.3, 1.0), interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    manual = v2.Compose([crop, v2.RandomHorizontalFlip(), v2.Normalize([0.5], [0.25])])
    for seed in range(4):
        torch.manual_seed(seed)
        a = tf(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(a, manual(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_transform((16, 16), auto_augment="rand-m9-mstd0.5", **gray_kw)
    assert [(str(w.message), w.filename) for w in caught] == [
        ("1-channel images: RandAugment (rand-m9-mstd0.5) works on RGB only, left out", __file__)
    ]


def test_posterize_to_0_bits_is_black_in_every_augment_policy():
    """The posterize of RandAugment's ops and AutoAugment's policies is ours: 0 bits a black image (Pillow 13 refuses
    0), 1 bit and more timm's own."""
    from timm.data.auto_augment import posterize

    from mae.data.transforms import _posterize, train_transform

    kw = dict(scale=(0.3, 1.0), mean=(0.5,) * 3, std=(0.5,) * 3)
    for policy in ("rand-m9-mstd0.5-inc1", "v0", "original"):
        augment = next(t for t in train_transform((32, 32), auto_augment=policy, **kw).transforms
                       if hasattr(t, "ops") or hasattr(t, "policy"))  # fmt: skip
        ops = getattr(augment, "ops", None) or [op for sub in augment.policy for op in sub]
        posterizes = [op for op in ops if op.name.startswith("Posterize")]
        assert posterizes and all(op.aug_fn is _posterize for op in posterizes), policy
    img = Image.fromarray((torch.arange(48).view(4, 4, 3) * 5).byte().numpy())
    assert not any(_posterize(img, 0).getdata()[i] != (0, 0, 0) for i in range(16))
    for bits in (1, 4):
        assert list(_posterize(img, bits).getdata()) == list(posterize(img, bits).getdata())
    assert list(_posterize(img, 1).getdata()) != list(_posterize(img, 0).getdata())
