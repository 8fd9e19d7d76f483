"""Anomaly maps from a masked autoencoder, and the numbers that judge them.

An MAE trained on normal images reconstructs normal content well and anomalous content badly, so its
reconstruction error under masking is an anomaly map. Each image is reconstructed under K complementary
mask sets: a seeded permutation of the patches cut into K runs, run k visible in set k and masked in the
other K - 1, so every patch is predicted equally often (K - 1 times; where K does not divide the patch count
the runs overlap by a patch or so and the average takes each patch's own count). The per-pixel squared error,
in the space the model was trained to predict (per-patch normalised pixels when `norm_pix_loss`), averaged
over its predictions and over channels, is the map; an aggregate of the map is the image's score.

    model = mae.load_pretrained("runs/pretrain")            # with its decoder (`load_with_decoder` checks)
    maps, scores = anomaly_maps(model, images, masks=4, seed=0)   # images normalised as in training

Beside it, feature-distance scores, which see semantic outliers that reconstruct well: `knn_distance`, the
cosine distance of an image's encoder features to its nearest training images; `gaussian_distance`, their
Mahalanobis distance to a Gaussian fitted to the training images' features (`encoder_features`: of the whole
image, or of its masked views as in pretraining); and `position_distance`, one Gaussian per patch position on
`patch_tokens`, each position's token judged apart, its maps the patch grid upsampled (`position_maps`). `auroc`
and `average_precision` judge any score against known anomalies (no scikit-learn: ranks and a cumulative sum),
`pro_auc` a map against masks of the anomalous regions (MVTec AD's per-region overlap).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from mae.errors import CheckpointError
from mae.models import MaskedAutoencoder

AGGREGATES = ("topk_mean", "mean", "max")
NEEDS_DECODER = (
    "holds an encoder only, and reconstruction maps need its trained decoder: give a pretraining run folder or an "
    "export written with --with_decoder"
)


def load_with_decoder(path: str | os.PathLike) -> MaskedAutoencoder:
    """`mae.load_pretrained(path)`, refused where the file holds an encoder only (an encoder export, a timm MAE
    encoder, `mae convert` of one): its decoder would be freshly initialised, and its maps noise. `CheckpointError`
    then."""
    from mae.weights.importers import load_noting_decoder

    model, has_decoder = load_noting_decoder(path)
    if not has_decoder:
        raise CheckpointError(f"{path} {NEEDS_DECODER}")
    return model


def complementary_noise(num_patches: int, masks: int, seed: int) -> tuple[torch.Tensor, float]:
    """(noise [K, L], mask_ratio) for K complementary mask sets over L patches: set k keeps the k-th run of
    a seeded permutation (ascending noise = kept first, as `MaskedAutoencoder.forward` ranks it)."""
    if not 2 <= masks <= num_patches:
        raise ValueError(f"masks={masks}: must be in [2, {num_patches}] (the patch count)")
    keep = -(-num_patches // masks)  # ceil: the K runs cover every patch
    perm = torch.randperm(num_patches, generator=torch.Generator().manual_seed(seed))
    rank = torch.empty(num_patches, dtype=torch.long)
    rank[perm] = torch.arange(num_patches)
    noise = torch.stack([((rank - k * keep) % num_patches).float() for k in range(masks)])
    # Half a patch above `keep` so that `int(L * (1 - ratio))` gives `keep` whatever the float rounding.
    return noise, 1.0 - (keep + 0.5) / num_patches


@contextlib.contextmanager
def _predict_every_masked_patch(model: MaskedAutoencoder) -> Iterator[None]:
    """A decoder that predicts a fraction of the masked patches (CrossMAE's `predict_ratio`) predicts them all."""
    decoder = model.decoder
    ratio = getattr(decoder, "predict_ratio", None)
    if ratio is not None:
        decoder.predict_ratio = 1.0
    try:
        yield
    finally:
        if ratio is not None:
            decoder.predict_ratio = ratio


@torch.no_grad()
def error_maps(model: MaskedAutoencoder, images: torch.Tensor, masks: int = 4, seed: int = 0) -> torch.Tensor:
    """`images` [N, C, H, W], normalised as the model was trained -> maps [N, H, W]: the squared error per
    pixel (mean over channels) of the masked predictions, averaged over the K complementary mask sets.

    The same `seed` gives the same mask sets for every image, in any batch and on any process."""
    noise, ratio = complementary_noise(model.num_patches, masks, seed)
    target = model.forward_target(images.float())
    total = torch.zeros_like(target)
    count = torch.zeros(target.shape[:2], device=target.device)
    with _predict_every_masked_patch(model):
        for k in range(masks):
            set_noise = noise[k].to(images.device).expand(len(images), -1)
            latent, masking = model.forward_encoder(images, ratio, set_noise)
            pred, predicted = model.decoder(latent, masking.ids_restore)
            used = masking.mask * predicted  # [N, L]: 1 where this set masked and predicted the patch
            total += (pred.float() - target).pow(2) * used.unsqueeze(-1)
            count += used
    per_pixel = model.unpatchify(total / count.clamp_min(1).unsqueeze(-1))  # [N, C, H, W]
    return per_pixel.mean(1)


def aggregate(maps: torch.Tensor, how: str = "topk_mean", top_percent: float = 1.0) -> torch.Tensor:
    """maps [N, H, W] -> scores [N]: the mean of each map's highest `top_percent`% pixels (at least one),
    its mean, or its maximum."""
    flat = maps.flatten(1).float()
    if how == "mean":
        return flat.mean(1)
    if how == "max":
        return flat.amax(1)
    if how == "topk_mean":
        k = max(1, round(flat.shape[1] * top_percent / 100))
        return flat.topk(k, dim=1).values.mean(1)
    raise ValueError(f"aggregate {how!r}: choose one of {', '.join(AGGREGATES)}")


def anomaly_maps(
    model: MaskedAutoencoder,
    images: torch.Tensor,
    masks: int = 4,
    seed: int = 0,
    how: str = "topk_mean",
    top_percent: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(maps [N, H, W], scores [N]) of `images` [N, C, H, W] (normalised as in training; H, W the model's):
    `error_maps` and their `aggregate`. Higher is more anomalous. The model runs in eval mode (restored)."""
    was_training = model.training
    model.eval()
    try:
        maps = error_maps(model, images, masks, seed)
    finally:
        model.train(was_training)
    return maps, aggregate(maps, how, top_percent)


@torch.no_grad()
def encoder_features(model: MaskedAutoencoder, images: torch.Tensor, masks: int = 0, seed: int = 0) -> torch.Tensor:
    """[N, C, H, W] -> [N, D]: the encoder's patch tokens, averaged. `masks` 0: the whole image at once; K >= 2: the
    image as the encoder saw it in pretraining, the visible patches of each of K complementary mask sets (the maps'
    sets, from `seed`) at a time, their token means averaged over the sets."""
    if not masks:
        return patch_tokens(model, images).mean(1)
    return masked_view_features(model, images, masks, seed).mean(0)


@torch.no_grad()
def patch_tokens(model: MaskedAutoencoder, images: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> [N, L, D]: the encoder's tokens of the whole image, one per patch position (prefix tokens
    left out), in patch order: `encoder_features` before its mean, `position_distance`'s input."""
    return model.encoder.forward_features(images)[:, model.encoder.num_prefix_tokens :].float()


@torch.no_grad()
def masked_view_features(model: MaskedAutoencoder, images: torch.Tensor, masks: int, seed: int = 0) -> torch.Tensor:
    """[N, C, H, W] -> [K, N, D]: for each of K complementary mask sets (the maps' sets, from `seed`), the encoder's
    tokens of that set's visible patches, averaged."""
    noise, ratio = complementary_noise(model.num_patches, masks, seed)
    prefix = model.encoder.num_prefix_tokens
    per_set = [model.forward_encoder(images, ratio, noise[k].to(images.device).expand(len(images), -1))[0]
               for k in range(masks)]  # fmt: skip
    return torch.stack([latent[:, prefix:].float().mean(1) for latent in per_set])


def knn_distance(bank: torch.Tensor, query: torch.Tensor, k: int = 5, chunk: int = 1024) -> torch.Tensor:
    """[Q]: each query's mean cosine distance (1 - similarity) to its `k` most similar rows of `bank` [B, D]."""
    bank = F.normalize(bank.float(), dim=1)
    k = min(k, len(bank))
    out = []
    for start in range(0, len(query), chunk):
        q = F.normalize(query[start : start + chunk].float(), dim=1)
        out.append(1 - (q @ bank.T).topk(k, dim=1).values.mean(1))
    return torch.cat(out) if out else torch.zeros(0)


def gaussian_distance(bank: torch.Tensor, query: torch.Tensor, shrinkage: float = 1e-3) -> torch.Tensor:
    """[Q]: each query's squared Mahalanobis distance to a Gaussian fitted to `bank` [B, D] (the normal images'
    features): mean and covariance of the bank, the covariance shrunk towards `shrinkage` x its mean variance on
    the diagonal so that it inverts whatever B and D. Computed in float64."""
    if not shrinkage > 0:
        raise ValueError(f"shrinkage={shrinkage}: must be > 0")
    bank, query = bank.double(), query.double()
    mu = bank.mean(0)
    cov = torch.cov(bank.T, correction=1 if len(bank) > 1 else 0).reshape(bank.shape[1], bank.shape[1])
    cov = cov + shrinkage * max(float(cov.diagonal().mean()), 1e-12) * torch.eye(len(cov), dtype=cov.dtype)
    centred = query - mu
    return torch.linalg.solve(cov, centred.T).T.mul(centred).sum(1).float()


def position_distance(bank: torch.Tensor, query: torch.Tensor, shrinkage: float = 1e-3) -> torch.Tensor:
    """[Q, L]: `gaussian_distance` at each patch position apart (PaDiM's model): one Gaussian per position, fitted
    to the bank's tokens there ([B, L, D], `patch_tokens`), and each query token's [Q, L, D] distance to its own
    position's. Where the image's Gaussian sees the tokens' mean, this sees where in the image a token is unusual:
    its mean over positions is an image's score, the [Q, L] grid itself a coarse map."""
    if bank.shape[1:] != query.shape[1:]:
        raise ValueError(f"bank {tuple(bank.shape)} and query {tuple(query.shape)}: not the same positions and width")
    return torch.stack([gaussian_distance(bank[:, p], query[:, p], shrinkage) for p in range(bank.shape[1])], 1)


def position_maps(distances: torch.Tensor, model: MaskedAutoencoder, blur: float = 0.0) -> torch.Tensor:
    """`position_distance`'s [N, L] -> maps [N, H, W] at the model's input size, aligned with the input as
    `error_maps` are: the patch grid upsampled bilinearly (each value at its patch's centre), then, with `blur` > 0,
    smoothed by a Gaussian of that standard deviation in pixels (PatchCore's 4 at 224 px)."""
    (gh, gw), size = model.grid_size, tuple(model.img_size)
    grid = distances.float().view(-1, 1, gh, gw)
    maps = F.interpolate(grid, size=size, mode="bilinear", align_corners=False)
    if blur > 0:
        from torchvision.transforms.v2.functional import gaussian_blur

        # 3 sigmas a side, and less than the map's side (the reflected padding's limit)
        side = min(2 * int(np.ceil(3 * blur)) + 1, 2 * ((min(size) - 1) // 2) + 1)
        maps = gaussian_blur(maps, [side, side], [blur, blur])
    return maps[:, 0]


def pro_auc(maps: np.ndarray | torch.Tensor, masks: np.ndarray | torch.Tensor, max_fpr: float = 0.3) -> float:
    """MVTec AD's per-region overlap (Bergmann et al., 2021): `maps` [N, H, W], `masks` [N, H, W] bool (True =
    anomalous pixel). At each threshold, PRO is the mean over the masks' connected regions (8-connected, each
    image's own) of the share of the region's pixels above it, and the false positive rate the share of all normal
    pixels above it; the area under PRO against FPR from 0 to `max_fpr`, divided by `max_fpr` (1 = perfect). Every
    distinct score is a threshold. NaN without a region or without a normal pixel."""
    from scipy.ndimage import label

    s, m = np.asarray(maps, dtype=np.float64), np.asarray(masks).astype(bool)
    regions = np.zeros(m.shape, dtype=np.int64)
    count = 0
    for i in range(len(m)):
        labelled, n = label(m[i], structure=np.ones((3, 3)))
        regions[i] = np.where(labelled > 0, labelled + count, 0)
        count += n
    normal = int((~m).sum())
    if count == 0 or normal == 0:
        return float("nan")
    sizes = np.bincount(regions.ravel(), minlength=count + 1)
    # each anomalous pixel weighs 1 / (its region's size x the region count): summed above a threshold, the PRO
    weight = np.where(regions > 0, 1.0 / (sizes[regions] * count), 0.0).ravel()
    order = np.argsort(-s.ravel(), kind="stable")
    flat, weight, neg = s.ravel()[order], weight[order], (~m).ravel()[order]
    last = np.r_[np.flatnonzero(np.diff(flat)), len(flat) - 1]  # the last pixel of each run of equal scores
    fpr, pro = np.r_[0.0, np.cumsum(neg)[last] / normal], np.r_[0.0, np.cumsum(weight)[last]]
    end = int(np.searchsorted(fpr, max_fpr, side="right"))  # the points with fpr <= max_fpr
    x, y = fpr[:end], pro[:end]
    if end < len(fpr) and x[-1] < max_fpr:  # the curve up to max_fpr, interpolated on the segment that crosses it
        t = (max_fpr - fpr[end - 1]) / (fpr[end] - fpr[end - 1])
        x, y = np.r_[x, max_fpr], np.r_[y, pro[end - 1] + t * (pro[end] - pro[end - 1])]
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2) / max_fpr)  # the trapezoids


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2)[inverse.reshape(-1)]


def auroc(scores: np.ndarray | torch.Tensor, anomalous: np.ndarray | torch.Tensor) -> float:
    """Area under the ROC curve with the anomalies as positives (higher score = more anomalous): the
    Mann-Whitney U of the scores' ranks, ties counted half. NaN without both kinds."""
    s, y = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(anomalous).astype(bool).ravel()
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = _average_ranks(s)
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _by_threshold(s: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(true positives, false positives) at each distinct score taken as the threshold, highest first."""
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last row of each run of equal scores
    tp = np.cumsum(y)[last]
    return tp, (last + 1) - tp


def average_precision(scores: np.ndarray | torch.Tensor, anomalous: np.ndarray | torch.Tensor) -> float:
    """Area under the precision-recall curve as average precision: sum over thresholds of (recall step) x
    precision, the anomalies as positives; scikit-learn's definition. NaN without anomalies."""
    s, y = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(anomalous).astype(bool).ravel()
    if not y.any():
        return float("nan")
    tp, fp = _by_threshold(s, y)
    recall = tp / y.sum()
    precision = tp / (tp + fp)
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def roc_curve(scores: np.ndarray | torch.Tensor, anomalous: np.ndarray | torch.Tensor) -> tuple[np.ndarray, ...]:
    """(false positive rates, true positive rates), from (0, 0) to (1, 1), one point per distinct score."""
    s, y = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(anomalous).astype(bool).ravel()
    tp, fp = _by_threshold(s, y)
    return np.r_[0.0, fp / max(1, (~y).sum())], np.r_[0.0, tp / max(1, y.sum())]
