"""The Fashion-MNIST one-class anomaly study (docs/anomaly.md): for each class, pretrain an MAE on that class's
6,000 training images only (recipes/anomaly/fashion_mnist_one_class.yaml), score all 10,000 test images, and
report the AUROC with that class as normal; mean over classes, per seed. Side by side on the same split: the
MAE's reconstruction score under every aggregate, its encoder's k-NN feature distance, the same two from a
random-init model of the same architecture, k-NN distance on raw pixels, and PCA reconstruction error.

    apt-get install -y dataset-fashion-mnist          # IDX files in /usr/share/datasets/fashion-mnist/
    python scripts/anomaly_study.py --output runs/anomaly_study                      # the full protocol
    python scripts/anomaly_study.py --classes 0 1 --seeds 0 --epochs 4 --output runs/anomaly_quick   # reduced

Public API only: `mae.pretrain`, `mae.load_pretrained` (through `mae.anomaly_maps.load_with_decoder`),
`mae.anomaly_maps`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from prepare_fashion_mnist import CLASSES, DEBIAN, IDX, idx_file, read_idx  # noqa: E402

import mae  # noqa: E402
from mae.anomaly_maps import aggregate, anomaly_maps, auroc, encoder_features, knn_distance, load_with_decoder  # noqa: E402
from mae.run_folder import run_config  # noqa: E402

RECIPE = Path(__file__).parents[1] / "recipes" / "anomaly" / "fashion_mnist_one_class.yaml"
AGGREGATES = {"mean": ("mean", 100.0), "max": ("max", 100.0), "top1%": ("topk_mean", 1.0),
              "top5%": ("topk_mean", 5.0), "top10%": ("topk_mean", 10.0)}  # fmt: skip
K = 5  # neighbours of the k-NN scores
PCA_COMPONENTS = 32


def load_split(source: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images, labels = (read_idx(idx_file(source, name)) for name in IDX[split])
    return images, labels.astype(np.int64)


def write_class_folder(images: np.ndarray, folder: Path) -> Path:
    if not (folder / "done").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            Image.fromarray(img).save(folder / f"{i:05d}.png")
        (folder / "done").touch()
    return folder


def as_input(images: np.ndarray, mean, std) -> torch.Tensor:
    x = torch.from_numpy(images).float().div(255).unsqueeze(1)
    return (x - mean[0]) / std[0]


@torch.no_grad()
def model_scores(model, train_x: torch.Tensor, test_x: torch.Tensor, seed: int, batch: int = 500) -> dict:
    """Reconstruction scores under every aggregate, and the k-NN feature distance, for the test images."""
    model.eval()
    maps = torch.cat([anomaly_maps(model, test_x[i : i + batch], masks=4, seed=seed)[0]
                      for i in range(0, len(test_x), batch)])  # fmt: skip
    scores = {f"recon {name}": aggregate(maps, how, top) for name, (how, top) in AGGREGATES.items()}
    bank = torch.cat([encoder_features(model, train_x[i : i + batch]) for i in range(0, len(train_x), batch)])
    query = torch.cat([encoder_features(model, test_x[i : i + batch]) for i in range(0, len(test_x), batch)])
    scores["knn features"] = knn_distance(bank, query, K)
    return scores


def baselines(train: np.ndarray, test: np.ndarray) -> dict:
    """k-NN cosine distance on raw pixels, and PCA reconstruction error (fitted on the normal class)."""
    a, b = torch.from_numpy(train).float().flatten(1) / 255, torch.from_numpy(test).float().flatten(1) / 255
    mu = a.mean(0)
    _, _, v = torch.linalg.svd(a - mu, full_matrices=False)
    basis = v[:PCA_COMPONENTS].T
    centred = b - mu
    residual = centred - centred @ basis @ basis.T
    return {"knn raw pixels": knn_distance(a, b, K), "pca error": residual.pow(2).sum(1)}


def one_class(args, c: int, seed: int, data: dict) -> dict:
    (train_x, train_y), (test_x, test_y) = data["train"], data["test"]
    normal = train_x[train_y == c]
    anomalous = test_y != c
    run = args.output / f"class{c}_seed{seed}"
    folder = write_class_folder(normal, args.output / "classes" / str(c))
    t = time.time()
    if not (run / "encoder.safetensors").exists():
        overrides = {"loop": {"epochs": args.epochs}} if args.epochs else {}
        mae.pretrain(config=str(RECIPE), data={"path": str(folder)}, output_dir=str(run), seed=seed, **overrides)
    minutes = (time.time() - t) / 60
    stats = run_config(run)["data"]
    model = load_with_decoder(run)
    result = {}
    for name, m in (("mae", model), ("random-init", random_like(run, seed))):
        scores = model_scores(m, as_input(normal, stats["mean"], stats["std"]),
                              as_input(test_x, stats["mean"], stats["std"]), seed)  # fmt: skip
        result.update({f"{name} {k}": auroc(v.numpy(), anomalous) for k, v in scores.items()})
    result.update({k: auroc(v.numpy(), anomalous) for k, v in baselines(normal, test_x).items()})
    result["pretrain minutes"] = minutes
    print(f"class {c} ({CLASSES[c]}), seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True)
    return result


def random_like(run: Path, seed: int):
    """The run's architecture with fresh weights (seeded): what the pretraining adds over none."""
    cfg = yaml.safe_load(RECIPE.read_text())["model"]
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "masking")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mae.create_mae(cfg["name"], **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEBIAN, help="folder of the four IDX files")
    parser.add_argument("--output", type=Path, default=Path("runs/anomaly_study"))
    parser.add_argument("--classes", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=None, help="shorten the recipe (a reduced protocol)")
    args = parser.parse_args()
    data = {split: load_split(args.source, split) for split in ("train", "test")}
    results = {f"{c}/{s}": one_class(args, c, s, data) for s in args.seeds for c in args.classes}
    methods = [k for k in next(iter(results.values())) if k != "pretrain minutes"]
    summary = {}
    for s in args.seeds:
        per_seed = [results[f"{c}/{s}"] for c in args.classes]
        summary[f"seed {s}"] = {m: float(np.mean([r[m] for r in per_seed])) for m in methods}
    summary["mean over seeds"] = {m: float(np.mean([v[m] for v in summary.values()])) for m in methods}
    protocol = {"classes": args.classes, "seeds": args.seeds, "epochs": args.epochs or "recipe"}
    (args.output / "results.json").write_text(json.dumps({"protocol": protocol, "per_run": results,
                                                          "summary": summary}, indent=1))  # fmt: skip
    print(f"\nmean AUROC over classes {args.classes} (seeds {args.seeds}):")
    for m in methods:
        print(f"  {m:28s} {summary['mean over seeds'][m]:.4f}")


if __name__ == "__main__":
    main()
