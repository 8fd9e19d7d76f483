"""mae.anomaly_maps: complementary masks, maps aligned with the input at any size and channel count, determinism, the
aggregates, and AUROC / AUPR against brute force."""

import itertools
import re
import warnings

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
    error_maps,
    gaussian_distance,
    knn_distance,
    load_with_decoder,
    masked_view_features,
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
    coarse = rng.integers(0, 4, masks.shape) + masks * rng.integers(0, 2, masks.shape)  # ties across the cut
    for max_fpr in (0.3, 0.05, 1.0):
        assert pro_auc(maps, masks, max_fpr) == pytest.approx(brute_pro(maps, masks, max_fpr))
        assert pro_auc(coarse, masks, max_fpr) == pytest.approx(brute_pro(coarse, masks, max_fpr))
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


def test_each_set_keeps_its_own_run_of_the_seeded_permutation():
    """Set k keeps the k-th run of `keep` patches of the seed's permutation (the last run wrapping round to the
    first patches where K does not divide L), as documented; `masks` outside [2, L] is one line."""
    for length, masks in ((16, 4), (10, 3)):
        noise, ratio = complementary_noise(length, masks, seed=5)
        keep = -(-length // masks)
        perm = torch.randperm(length, generator=torch.Generator().manual_seed(5))
        for k in range(masks):
            kept = set(noise[k].argsort()[:keep].tolist())
            assert kept == {int(perm[(k * keep + j) % length]) for j in range(keep)}
            assert int(length * (1 - ratio)) == keep
    with pytest.raises(ValueError, match=r"^masks=1: must be in \[2, 16\] \(the patch count\)$"):
        complementary_noise(16, 1, seed=0)


def test_the_map_is_each_patch_error_where_it_was_masked():
    """With two complementary sets each patch is masked in exactly one, so the map's mean is the mean of the two
    sets' MAE losses (the loss: the squared error per masked pixel), for a model that predicts something."""
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32, norm_pix_loss=False).eval()
    x = torch.randn(3, 3, 32, 32)
    maps, _ = anomaly_maps(model, x, masks=2, seed=4)
    noise, ratio = complementary_noise(model.num_patches, 2, seed=4)
    with torch.no_grad():
        losses = [model(x[i : i + 1], ratio, noise[k][None]).loss for i in range(3) for k in range(2)]
    torch.testing.assert_close(maps.mean((1, 2)), torch.stack(losses).view(3, 2).mean(1))


def test_the_documented_defaults():
    """masks=4, seed=0, the top 1% of the map; k=5 neighbours; shrinkage 1e-3: each function called bare gives what
    the same call with the documented values gives, and those differ from their neighbours."""
    torch.manual_seed(0)
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
    x = torch.randn(4, 3, 32, 32)
    maps, scores = anomaly_maps(model, x)
    explicit = anomaly_maps(model, x, masks=4, seed=0, how="topk_mean", top_percent=1.0)
    assert torch.equal(maps, explicit[0]) and torch.equal(scores, explicit[1])
    assert torch.equal(error_maps(model, x), maps) and not torch.equal(error_maps(model, x, 5, 0), maps)
    assert not torch.equal(error_maps(model, x, 4, 1), maps)
    many = torch.rand(2, 1000, generator=torch.Generator().manual_seed(0))  # 1% = the top 10 of 1,000 pixels
    assert torch.equal(aggregate(many), many.topk(10).values.mean(1))
    assert torch.equal(aggregate(many, "topk_mean", 10), many.topk(100).values.mean(1))  # 100, not 99
    assert torch.equal(encoder_features(model, x, masks=4), encoder_features(model, x, masks=4, seed=0))
    assert torch.equal(masked_view_features(model, x, 4), masked_view_features(model, x, 4, seed=0))
    assert not torch.equal(masked_view_features(model, x, 4, seed=1), masked_view_features(model, x, 4))
    bank, query = torch.randn(30, 6), torch.randn(5, 6)
    assert torch.equal(knn_distance(bank, query), knn_distance(bank, query, k=5))
    assert not torch.equal(knn_distance(bank, query, k=6), knn_distance(bank, query))
    assert torch.equal(gaussian_distance(bank, query), gaussian_distance(bank, query, 1e-3))
    assert not torch.equal(gaussian_distance(bank, query, 1.001), gaussian_distance(bank, query))
    tokens, queries = torch.randn(30, 3, 6), torch.randn(5, 3, 6)
    assert torch.equal(position_distance(tokens, queries), position_distance(tokens, queries, 1e-3))
    assert not torch.equal(position_distance(tokens, queries, 1.001), position_distance(tokens, queries))


def test_features_carry_no_gradient():
    """Scoring builds no autograd graph, whatever the model's parameters ask."""
    model = mae.create_mae("mae_vit_micro_patch8", img_size=32).eval()
    assert any(p.requires_grad for p in model.parameters())  # the fixed sin-cos positions aside
    x = torch.randn(2, 3, 32, 32)
    for out in (encoder_features(model, x), patch_tokens(model, x), masked_view_features(model, x, 4),
                anomaly_maps(model, x)[0]):  # fmt: skip
        assert not out.requires_grad


def test_errors_are_one_whole_line(tmp_path):
    maps = torch.zeros(1, 4, 4)
    with pytest.raises(ValueError, match=r"^aggregate 'median': choose one of topk_mean, mean, max$"):
        aggregate(maps, "median")
    with pytest.raises(ValueError, match=r"^shrinkage=-1: must be > 0$"):
        gaussian_distance(torch.zeros(3, 2), torch.zeros(1, 2), shrinkage=-1)
    with pytest.raises(ValueError, match=r"^bank \(3, 2, 2\) and query \(1, 1, 2\): not the same positions and width$"):
        position_distance(torch.zeros(3, 2, 2), torch.zeros(1, 1, 2))
    path = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8", img_size=32), tmp_path / "enc.safetensors")
    expected = (f"{path} holds an encoder only, and reconstruction maps need its trained decoder: give a pretraining"
                " run folder or an export written with --with_decoder")  # fmt: skip
    with pytest.raises(mae.CheckpointError, match=f"^{re.escape(expected)}$"):
        load_with_decoder(path)


def test_distances_on_small_and_degenerate_banks():
    """One bank row: no covariance but the shrinkage's floor, a finite distance; two rows: the unbiased covariance
    (numpy's); a constant bank: the floor 1e-12 x shrinkage on the diagonal; no query: an empty result."""
    query = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    one = gaussian_distance(torch.tensor([[0.0, 0.0]]), query)
    torch.testing.assert_close(one, torch.tensor([5.0, 0.0]) / 1e-15)
    two = np.array([[0.0, 1.0], [2.0, 5.0]])
    cov = np.cov(two.T) + 1e-3 * np.trace(np.cov(two.T)) / 2 * np.eye(2)
    d = query.numpy() - two.mean(0)
    expected = np.einsum("qi,ij,qj->q", d, np.linalg.inv(cov), d)
    np.testing.assert_allclose(gaussian_distance(torch.from_numpy(two), query).numpy(), expected, rtol=1e-5)
    constant = gaussian_distance(torch.ones(5, 2), torch.tensor([[2.0, 1.0]]))
    torch.testing.assert_close(constant, torch.tensor([1.0 / 1e-15]))
    assert knn_distance(torch.randn(4, 3), torch.zeros(0, 3)).shape == (0,)


def test_blur_is_a_gaussian_of_three_sigmas_a_side_cut_to_the_map():
    """`blur` = sigma in pixels: scipy's Gaussian filter with a radius of ceil(3 sigma), mirrored at the borders,
    the radius cut below half the map's short side (odd or even); any blur > 0 smooths."""
    from scipy.ndimage import gaussian_filter

    for size, patch in (((24, 40), 8), ((21, 35), 7)):
        model = mae.create_mae("mae_vit_micro_patch8", img_size=size, patch_size=patch)
        grid = torch.rand(2, model.num_patches, generator=torch.Generator().manual_seed(1))
        sharp = position_maps(grid, model).numpy()
        for blur in (0.5, 1.5, 6.0):
            radius = min(int(np.ceil(3 * blur)), (min(size) - 1) // 2)
            expected = [gaussian_filter(m, blur, radius=radius, mode="mirror") for m in sharp]
            np.testing.assert_allclose(position_maps(grid, model, blur).numpy(), expected, rtol=1e-4, atol=1e-6)


def test_one_sided_or_one_of_a_kind_labels():
    """AUROC and AP without warnings; NaN where a kind is missing; the ROC with a single image of a kind."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(auroc([1.0, 2.0], [1, 1])) and np.isnan(auroc([1.0, 2.0], [0, 0]))
        assert np.isnan(average_precision([1.0, 2.0], [0, 0]))
    fpr, tpr = roc_curve([3.0, 1.0], [1, 0])
    assert fpr.tolist() == [0.0, 0.0, 1.0] and tpr.tolist() == [0.0, 1.0, 1.0]
    masks = np.ones((1, 3, 3), bool)
    masks[0, 0, 0] = False  # one normal pixel
    assert pro_auc(np.arange(9.0).reshape(1, 3, 3), masks) == pytest.approx(1.0)
