"""mae.anomaly_maps: complementary masks, maps aligned with the input at any size and channel count, determinism, the
aggregates, and AUROC / AUPR against brute force."""

import itertools

import numpy as np
import pytest
import torch

import mae
from mae.anomaly_maps import (
    aggregate,
    anomaly_maps,
    auroc,
    average_precision,
    complementary_noise,
    encoder_features,
    gaussian_distance,
    knn_distance,
    load_with_decoder,
    patch_tokens,
    position_distance,
    position_maps,
    pro_auc,
    roc_curve,
)
from mae.models.masking import random_masking


def brute_auroc(s, y):
    pos, neg = s[y], s[~y]
    return np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)])


def brute_ap(s, y):
    """sum over each distinct threshold t, highest first, of (recall(t) - recall(previous)) x precision(t)."""
    total, last_recall = 0.0, 0.0
    for t in sorted(set(s.tolist()), reverse=True):
        chosen = s >= t
        recall = (chosen & y).sum() / y.sum()
        total += (recall - last_recall) * (chosen & y).sum() / chosen.sum()
        last_recall = recall
    return total


@pytest.mark.parametrize("seed", range(5))
def test_auroc_and_average_precision_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 6, 40).astype(float)  # many ties
    y = rng.random(40) < 0.3
    assert auroc(s, y) == pytest.approx(brute_auroc(s, y))
    assert average_precision(s, y) == pytest.approx(brute_ap(s, y))
    fpr, tpr = roc_curve(s, y)
    area = np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2)  # the trapezoid rule by hand (np.trapezoid needs NumPy 2)
    assert area == pytest.approx(brute_auroc(s, y))  # ties as straight segments: the same area
    assert auroc([1.0, 2.0, 3.0], [0, 1, 1]) == 1.0 and auroc([3.0, 1.0], [0, 1]) == 0.0
    assert np.isnan(auroc([1.0, 2.0], [0, 0]))


@pytest.mark.parametrize("length,masks", [(16, 4), (16, 2), (12, 5), (49, 4)])
def test_every_patch_is_masked_in_all_sets_but_its_own(length, masks):
    noise, ratio = complementary_noise(length, masks, seed=3)
    masked = torch.stack([random_masking(n[None], ratio).mask[0] for n in noise])  # [K, L]
    visible = masks - masked.sum(0)
    assert (visible >= 1).all()  # every patch is predicted by some other set's context, and masked somewhere
    if length % masks == 0:
        assert (masked.sum(0) == masks - 1).all()
    else:
        assert visible.sum() == masks * -(-length // masks)  # the runs overlap only by the rounding
    assert torch.equal(noise, complementary_noise(length, masks, seed=3)[0])


def silent_decoder(in_chans, img_size):
    """An MAE whose decoder predicts 0 everywhere: its error map is exactly the input squared (mean over
    channels), so where the map is large tells where the input is."""
    model = mae.create_mae("mae_vit_micro_patch8", in_chans=in_chans, img_size=img_size, norm_pix_loss=False)
    torch.nn.init.zeros_(model.decoder.pred.weight)
    torch.nn.init.zeros_(model.decoder.pred.bias)
    return model.eval()


@pytest.mark.parametrize("in_chans,img_size", [(1, (24, 40)), (13, (32, 16)), (3, 32)])
def test_map_is_aligned_with_the_input(in_chans, img_size):
    model = silent_decoder(in_chans, img_size)
    h, w = model.img_size
    x = torch.zeros(2, in_chans, h, w)
    x[0, :, 3:9, 5:14] = 2.0  # not on patch borders
    x[1, : in_chans // 2 + 1, h - 5 :, w - 7 :] = torch.randn(in_chans // 2 + 1, 5, 7)
    maps, scores = anomaly_maps(model, x, masks=4, seed=0)
    assert maps.shape == (2, h, w)
    torch.testing.assert_close(maps, x.pow(2).mean(1))
    assert scores[0] == pytest.approx(4.0)  # top 1% of the map: inside the square


def test_cross_decoder_predicts_every_masked_patch():
    model = mae.create_mae(
        "mae_vit_micro_patch8", img_size=32, decoder="cross", predict_ratio=0.25, norm_pix_loss=False
    )
    torch.nn.init.zeros_(model.decoder.pred.weight)
    torch.nn.init.zeros_(model.decoder.pred.bias)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(anomaly_maps(model, x)[0], x.pow(2).mean(1))
    assert model.decoder.predict_ratio == 0.25


def test_seeded_and_deterministic_in_any_batch():
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32)
    x = torch.randn(6, 3, 32, 32)
    maps, scores = anomaly_maps(model, x, seed=1)
    again, _ = anomaly_maps(model, x, seed=1)
    assert torch.equal(maps, again)
    torch.testing.assert_close(anomaly_maps(model, x[3:], seed=1)[0], maps[3:])  # a batch of its own: the same
    assert not torch.allclose(anomaly_maps(model, x, seed=2)[0], maps)
    assert model.training  # restored


def test_masked_view_features():
    """encoder_features(masks=K): each image seen a set of visible patches at a time, as in pretraining, the sets'
    token means averaged; seeded, the same in any batch. With one patch a set (K = the patch count) it is the mean
    over patches of the encoder run on that patch alone."""
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
    x = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        masked = encoder_features(model, x, masks=4, seed=1)
        assert masked.shape == encoder_features(model, x).shape
        assert torch.equal(masked, encoder_features(model, x, masks=4, seed=1))
        torch.testing.assert_close(encoder_features(model, x[3:], masks=4, seed=1), masked[3:])
        assert not torch.allclose(encoder_features(model, x, masks=4, seed=2), masked)
        assert not torch.allclose(encoder_features(model, x), masked)
        length, prefix = model.num_patches, model.encoder.num_prefix_tokens
        alone = []
        for j in range(length):
            noise = torch.ones(len(x), length)
            noise[:, j] = 0  # patch j kept, the rest masked
            latent, _ = model.forward_encoder(x, 1 - 1.5 / length, noise)
            alone.append(latent[:, prefix:].mean(1))
        one_each = encoder_features(model, x, masks=length, seed=3)
    torch.testing.assert_close(one_each, torch.stack(alone).mean(0), rtol=1e-4, atol=1e-5)


def test_aggregates():
    maps = torch.arange(200.0).view(2, 10, 10)
    assert aggregate(maps, "max").tolist() == [99.0, 199.0]
    assert aggregate(maps, "mean").tolist() == [49.5, 149.5]
    assert aggregate(maps, "topk_mean", 1).tolist() == [99.0, 199.0]  # 1% of 100 pixels: one
    assert aggregate(maps, "topk_mean", 5).tolist() == [97.0, 197.0]
    with pytest.raises(ValueError, match="choose one of topk_mean"):
        aggregate(maps, "median")


def test_knn_distance():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    query = torch.tensor([[2.0, 0.0], [-1.0, 0.0]])
    torch.testing.assert_close(knn_distance(bank, query, k=1), torch.tensor([0.0, 1.0]))  # cosine: scale-free
    torch.testing.assert_close(knn_distance(bank, query, k=2), torch.tensor([0.5 - 0.5**0.5 / 2, 1 + 0.5**0.5 / 2]))


def test_gaussian_distance():
    """The squared Mahalanobis distance to the bank's mean under its (shrunk) covariance: against numpy's
    inverse; a diagonal bank gives the per-axis z-scores squared; more shrinkage pulls towards Euclidean."""
    rng = np.random.default_rng(0)
    bank = rng.normal(size=(500, 4)) @ rng.normal(size=(4, 4)) + rng.normal(size=4)
    query = rng.normal(size=(7, 4)) * 3
    cov = np.cov(bank.T) + 0.1 * np.trace(np.cov(bank.T)) / 4 * np.eye(4)
    d = query - bank.mean(0)
    expected = np.einsum("qi,ij,qj->q", d, np.linalg.inv(cov), d)
    got = gaussian_distance(torch.from_numpy(bank), torch.from_numpy(query), shrinkage=0.1)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    axes = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 10.0], [0.0, -10.0]])  # variance 2/3 and 200/3, uncorrelated
    z = gaussian_distance(axes, torch.tensor([[2.0, 0.0], [0.0, 20.0]]), shrinkage=1e-9)
    torch.testing.assert_close(z, torch.tensor([6.0, 6.0]))  # 2^2 / (2/3) = 20^2 / (200/3) = 6
    near_euclidean = gaussian_distance(axes, torch.tensor([[2.0, 0.0], [0.0, 20.0]]), shrinkage=1e6)
    assert near_euclidean[1] / near_euclidean[0] == pytest.approx(100, rel=1e-3)
    with pytest.raises(ValueError, match="shrinkage=0: must be > 0"):
        gaussian_distance(axes, axes, shrinkage=0)


def test_position_distance():
    """One Gaussian per patch position: column p is `gaussian_distance` on position p's tokens alone; a token
    unusual for its position (moved from another position) stands out there only; `patch_tokens` are the tokens
    whose mean is `encoder_features`."""
    torch.manual_seed(0)
    bank = torch.randn(200, 3, 2) + torch.tensor([[0.0, 0.0], [5.0, 0.0], [0.0, 5.0]])  # 3 positions, 2 wide
    query = bank[:4].clone()
    query[0, 2] = bank[0, 1]  # position 1's token at position 2: normal anywhere but there
    d = position_distance(bank, query, 1e-2)
    assert d.shape == (4, 3)
    for p in range(3):
        torch.testing.assert_close(d[:, p], gaussian_distance(bank[:, p], query[:, p], 1e-2))
    assert int(d.mean(1).argmax()) == 0 and int(d[0].argmax()) == 2 and float(d[0, 2]) > 10 * float(d[1:, 2].max())
    assert float(gaussian_distance(bank.mean(1), query.mean(1), 1e-2)[0]) < float(d[0, 2])  # the mean hides it
    with pytest.raises(ValueError, match=r"bank \(200, 3, 2\) and query \(4, 2, 2\): not the same positions"):
        position_distance(bank, query[:, :2])
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
    x = torch.randn(5, 3, 32, 32)
    tokens = patch_tokens(model, x)
    assert tokens.shape == (5, model.num_patches, model.encoder.embed_dim)
    torch.testing.assert_close(tokens.mean(1), encoder_features(model, x))


def test_position_maps_upsample_the_patch_grid():
    """Each patch's distance sits at its patch's centre and the map is bilinear between centres (flat beyond the
    outer ones), at the model's size, patches in row order; --blur smooths it and keeps its mean away from the
    borders."""
    wide = mae.create_mae("mae_vit_micro_patch8", img_size=(24, 40))  # 3 x 5 patches of 8 px, in row order
    distances = torch.rand(2, 15, generator=torch.Generator().manual_seed(0))
    maps = position_maps(distances, wide)
    assert maps.shape == (2, 24, 40)
    grid = distances.view(2, 3, 5).double()
    for r, c in ((0, 0), (5, 13), (11, 20), (17, 37), (23, 39), (12, 3)):
        y, x = min(max((r + 0.5) / 8 - 0.5, 0), 2), min(max((c + 0.5) / 8 - 0.5, 0), 4)  # in patch units
        y0, x0 = min(int(y), 1), min(int(x), 3)
        fy, fx = y - y0, x - x0
        expected = ((1 - fy) * (1 - fx) * grid[:, y0, x0] + (1 - fy) * fx * grid[:, y0, x0 + 1]
                    + fy * (1 - fx) * grid[:, y0 + 1, x0] + fy * fx * grid[:, y0 + 1, x0 + 1])  # fmt: skip
        torch.testing.assert_close(maps[:, r, c].double(), expected, rtol=1e-5, atol=1e-6)
    spike = torch.zeros(1, 15)
    spike[0, 7] = 1.0  # the middle patch
    sharp, blurred = position_maps(spike, wide), position_maps(spike, wide, blur=3.0)
    assert blurred.max() < sharp.max() and float(blurred.sum()) == pytest.approx(float(sharp.sum()), rel=0.05)
    assert int(blurred[0].argmax()) // 40 in (11, 12) and int(blurred[0].argmax()) % 40 in (19, 20)


def brute_pro(maps, masks, max_fpr):
    """PRO integrated to max_fpr the slow way: every distinct score a threshold, each region's overlap counted
    pixel by pixel, the curve cut at max_fpr by linear interpolation."""
    from scipy.ndimage import label

    regions = []
    for i in range(len(masks)):
        labelled, n = label(masks[i], structure=np.ones((3, 3)))
        regions += [(i, labelled == j) for j in range(1, n + 1)]
    points = [(0.0, 0.0)]
    for t in sorted(set(maps.ravel().tolist()), reverse=True):
        above = maps >= t
        fpr = (above & ~masks).sum() / (~masks).sum()
        pro = np.mean([(above[i] & r).sum() / r.sum() for i, r in regions])
        points.append((fpr, pro))
    x, y = np.array(points).T
    keep = x <= max_fpr
    cut = np.interp(max_fpr, x, y)
    x, y = np.r_[x[keep], max_fpr], np.r_[y[keep], cut]
    return np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2) / max_fpr


@pytest.mark.parametrize("seed", range(4))
def test_pro_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    masks = np.zeros((3, 9, 9), bool)
    masks[0, 1:4, 1:3] = True
    masks[0, 6:8, 5:9] = True  # two regions in one image, of different sizes
    masks[1, 4, 4] = masks[1, 5, 5] = True  # diagonal neighbours: one region (8-connected)
    maps = rng.integers(0, 8, masks.shape).astype(float) + 3 * masks * rng.random(masks.shape)  # ties, some signal
    for max_fpr in (0.3, 0.05, 1.0):
        assert pro_auc(maps, masks, max_fpr) == pytest.approx(brute_pro(maps, masks, max_fpr))
    assert pro_auc(masks.astype(float), masks) == pytest.approx(1.0)  # every region found before any false positive
    assert pro_auc(np.ones(masks.shape), masks) == pytest.approx(0.15)  # one threshold: the diagonal, to 0.3
    assert np.isnan(pro_auc(maps, np.zeros_like(masks)))


def test_an_encoder_only_file_is_refused(tmp_path):
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32)
    path = mae.export_encoder(model, tmp_path / "encoder.safetensors")
    with pytest.raises(mae.CheckpointError, match="holds an encoder only, and reconstruction maps need"):
        load_with_decoder(path)
    from mae.weights.export import save_model

    full = save_model(model, tmp_path / "full.safetensors")
    assert load_with_decoder(full).decoder is not None
