"""The anomaly study's scores and its table: each method of the MAE and of its random-init twin is a `mae.anomaly`
run whose scores.csv the study reads back; the raw-pixel baselines are computed here; AUROC judges them all.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

import mae
from studies import harness

# Fashion-MNIST's class names, as results.json's class indices mean them (a kept study's table is drawn from its
# results.json alone, no data at hand).
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
AGGREGATES = {"mean": ("mean", 100.0), "max": ("max", 100.0), "top1%": ("topk_mean", 1.0),
              "top5%": ("topk_mean", 5.0), "top10%": ("topk_mean", 10.0)}  # fmt: skip
SHRINKAGES = (1e-3, 1e-2, 1e-1)  # of the Gaussian's covariance, towards its mean variance
K = 5  # neighbours of the k-NN scores
MASKS = 4  # `mae anomaly --masks`: the maps' complementary mask sets, and the masked views of the feature scores
PCA_COMPONENTS = 32
SETTING = " @ "  # "mae recon @ top1%": a method, and the setting chosen on val
# The study's methods: 1, the first; 2, with the Gaussian per patch position. Bumped with each method added, so that
# --rescore scores the runs kept before it again (their pretraining kept) and no others: a stopped rescore resumes.
SCORING = 2


def scorings(recon: bool) -> dict[str, dict]:
    """{method: the `mae.anomaly` options that score it}: k-NN and Gaussian on the whole image's features and on
    its masked views, a Gaussian per patch position; with `recon`, the reconstruction under every aggregate."""
    runs: dict[str, dict] = {}
    for features, what in (("full", "features"), ("masked", "masked features")):
        runs[f"knn {what}"] = {"score": "knn", "features": features}
        runs |= {f"gaussian {what} @ {s:g}": {"score": "gaussian", "features": features, "shrinkage": s}
                 for s in SHRINKAGES}  # fmt: skip
    runs |= {f"gaussian positions @ {s:g}": {"score": "gaussian", "features": "positions", "shrinkage": s}
             for s in SHRINKAGES}  # fmt: skip
    if recon:
        runs |= {f"recon @ {name}": {"score": "recon", "aggregate": how, "top_percent": top}
                 for name, (how, top) in AGGREGATES.items()}  # fmt: skip
    return runs


def random_init(run: Path, seed: int) -> Path:
    """The run's model (its record: architecture and statistics) with fresh weights (seeded), exported with its decoder
    beside the run: what the pretraining adds over none."""
    path = run / "random_init" / "encoder.safetensors"
    if not path.exists():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mae.export_encoder(mae.MaskedAutoencoder.from_spec(mae.read_spec(run)), path, with_decoder=True)
    return path


def read_scores(scores_csv: Path, n: int) -> np.ndarray:
    """The score of each of the `n` query images NNNNN.png, in row order, from a `mae anomaly` run's scores.csv."""
    out = np.full(n, np.nan)
    with scores_csv.open() as f:
        for row in csv.DictReader(f):
            out[int(Path(row["file"]).stem)] = float(row["score"])
    if np.isnan(out).any():
        raise mae.DataError(f"{scores_csv}: scores {int(np.isnan(out).sum())} of the {n} query images short")
    return out


def model_scores(run: Path, fit: Path, queries: Path, n: int, seed: int) -> dict[str, np.ndarray]:
    """Every method's scores of the `n` images in `queries`, against the normal images `fit`, for the MAE of `run`
    ("mae ...") and its random-init twin ("random-init ..."; no reconstruction: a random decoder's maps are noise).
    Each is a `mae.anomaly` run in RUN/scores/, in fp32 on the run's own input statistics; run once."""
    stats = harness.run_config(run)["data"]
    scores = {}
    for name, model in (("mae", run), ("random-init", random_init(run, seed))):
        for method, options in scorings(recon=name == "mae").items():
            out = run / "scores" / f"{name} {method}".replace(SETTING, "_").replace(" ", "_").replace("%", "pct")
            harness.stage("anomaly", out, pretrained=str(model), train_path=str(fit), seed=seed, masks=MASKS, k=K,
                          save_maps=False, loop={"batch_size": 500, "mixed_precision": "no"},
                          data={"path": str(queries), "mean": stats["mean"], "std": stats["std"], "num_workers": 0},
                          **options)  # fmt: skip
            scores[f"{name} {method}"] = read_scores(out / "scores.csv", n)
    return scores


def knn_distance(bank: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[Q]: each query's mean cosine distance to its K most similar rows of `bank`, as `mae anomaly --score knn`."""
    bank, query = torch.nn.functional.normalize(bank, dim=1), torch.nn.functional.normalize(query, dim=1)
    return torch.cat([1 - (q @ bank.T).topk(min(K, len(bank)), dim=1).values.mean(1) for q in query.split(1024)])


def gaussian_distance(bank: torch.Tensor, query: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """[Q]: squared Mahalanobis distance to a Gaussian fitted to `bank`, its covariance shrunk towards `shrinkage` x
    its mean variance on the diagonal, in float64, as `mae anomaly --score gaussian`."""
    bank, query = bank.double(), query.double()
    cov = torch.cov(bank.T)
    cov = cov + shrinkage * max(float(cov.diagonal().mean()), 1e-12) * torch.eye(len(cov), dtype=cov.dtype)
    centred = query - bank.mean(0)
    return torch.linalg.solve(cov, centred.T).T.mul(centred).sum(1).float()


def pixel_scores(train: np.ndarray, query: np.ndarray) -> dict[str, np.ndarray]:
    """On raw pixels: k-NN cosine distance, Gaussian distance, PCA reconstruction error (fitted on the normal class)."""
    a, b = torch.from_numpy(train).float().flatten(1) / 255, torch.from_numpy(query).float().flatten(1) / 255
    mu = a.mean(0)
    _, _, v = torch.linalg.svd(a - mu, full_matrices=False)
    basis = v[:PCA_COMPONENTS].T
    centred = b - mu
    scores = {"knn raw pixels": knn_distance(a, b), "pca error": (centred - centred @ basis @ basis.T).pow(2).sum(1)}
    scores |= {f"gaussian raw pixels @ {s:g}": gaussian_distance(a, b, s) for s in SHRINKAGES}
    return {k: v.numpy() for k, v in scores.items()}


def auroc(scores: np.ndarray, anomalous: np.ndarray) -> float:
    """Area under the ROC curve, the anomalies as positives: the Mann-Whitney U of the scores' ranks, ties counted
    half."""
    y = np.asarray(anomalous, dtype=bool)
    _, inverse, counts = np.unique(np.asarray(scores, dtype=np.float64), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse.reshape(-1)]  # 1-based, ties sharing their average
    pos, neg = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


# The study's methods as docs/results/anomaly.md's tables name and order them (a method not named here is left out).
TABLE_ROWS = {
    "mae gaussian positions": "MAE: Gaussian per patch position",
    "mae gaussian features": "MAE: Gaussian feature distance",
    "mae gaussian masked features": "MAE: Gaussian feature distance, masked views",
    "mae knn features": "MAE: k-NN feature distance",
    "mae knn masked features": "MAE: k-NN feature distance, masked views",
    "mae recon": "MAE: reconstruction",
    "random-init gaussian positions": "random-init: Gaussian per patch position",
    "random-init gaussian features": "random-init: Gaussian feature distance",
    "random-init gaussian masked features": "random-init: Gaussian feature distance, masked views",
    "random-init knn features": "random-init: k-NN feature distance",
    "random-init knn masked features": "random-init: k-NN feature distance, masked views",
    "gaussian raw pixels": "raw pixels: Gaussian distance",
    "knn raw pixels": "raw pixels: k-NN distance",
    "pca error": "raw pixels: PCA error",
}


def table(report: dict) -> str:
    """docs/results/anomaly.md's table of a study's results.json: test AUROC in percent, each method at its setting
    chosen on val; per class the mean over seeds, each seed's mean over classes, their mean and (val); the MAE's score
    bold."""
    classes, seeds = sorted(report["protocol"]["classes"]), sorted(report["protocol"]["seeds"])
    chosen, summary, runs = report["chosen_on_val"], report["summary"], report["per_run"]
    names = [f"{c} {CLASSES[c].split('/')[0].replace('Ankle b', 'B')}" for c in classes]  # "9 Boot", "0 T-shirt"
    lines = [f"| method (setting) | {' | '.join(names)} | {' | '.join(f'seed {s}' for s in seeds)} | **mean** (val) |",
             "|---" * (len(classes) + len(seeds) + 2) + "|"]  # fmt: skip
    for family, label in TABLE_ROWS.items():
        if family not in chosen:
            continue
        m = chosen[family]
        setting = f" ({m.split(SETTING)[1]})" if SETTING in m else ""
        per_class = [100 * np.mean([runs[f"{c}/{s}"]["test"][m] for s in seeds]) for c in classes]
        per_seed = [100 * summary["test"][f"seed {s}"][m] for s in seeds]
        mean, val = (100 * summary[part]["mean over seeds"][m] for part in ("test", "val"))
        first, last = (f"**{label}**{setting}", f"**{mean:.2f}** ({val:.2f})") if m == chosen["mae"] else (
            f"{label}{setting}", f"{mean:.2f} ({val:.2f})")  # fmt: skip
        cells = [first, *(f"{x:.1f}" for x in per_class), *(f"{x:.2f}" for x in per_seed), last]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)
