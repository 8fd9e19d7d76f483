"""The colour-defect study (docs/anomaly.md): for each category of a defect set in MVTec AD's layout
(scripts/defect_photos.py writes one: DATA/<category>/train/good, test/good, test/<defect>, ground_truth/<defect>),
pretrain an MAE with recipes/anomaly/rgb_defects.yaml on the category's normal training images, for each seed, and
score its test images with `mae anomaly` at its defaults (nothing chosen on test: no setting is tuned here). Beside it,
on the same images at the model's input size: `mae anomaly` at its defaults on a random-init model of the same
architecture (what pretraining adds), a Gaussian per patch position on raw pixel patches (PaDiM on pixels), and PCA
reconstruction error on pixels. Each method gives image AUROC, pixel AUROC and PRO (up to FPR 0.3).

    python scripts/defect_photos.py --output data/defect_photos
    python -m studies.anomaly_rgb --data data/defect_photos --output runs/anomaly_rgb          # 2 seeds, ~11 min a run
    python -m studies.anomaly_rgb --data data/defect_photos --output runs/anomaly_rgb_quick --quick   # minutes

`--quick`: one category, one seed, 2 epochs at 64 px: proves the pipeline, measures nothing. A finished run is not
run again (studies/harness.py), so a stopped study resumes. OUT/results.json holds every number, the CPU and the
minutes of each pretraining; OUT/results.md the table.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import torch

import mae
from studies import harness
from studies.anomaly_scores import auroc, gaussian_distance, random_init

RECIPE = harness.RECIPES / "anomaly" / "rgb_defects.yaml"
PCA_COMPONENTS = 32
QUICK = {"loop": {"epochs": 2, "eval_every": 2}, "optim": {"warmup_epochs": 0.2}, "model": {"img_size": 64}}


def categories(data: Path) -> list[Path]:
    return sorted(p for p in data.iterdir() if (p / "train" / "good").is_dir() and (p / "test").is_dir())


def read(folder: Path, model: mae.MaskedAutoencoder, stats: dict) -> tuple[torch.Tensor, list[Path]]:
    """The images below `folder`, resized whole to the model's input and normalised with the run's statistics."""
    from PIL import Image

    files = sorted(p for p in folder.rglob("*.png"))
    h, w = model.img_size
    x = torch.stack([torch.from_numpy(np.asarray(Image.open(f).convert("RGB").resize((w, h), Image.BILINEAR)))
                     for f in files]).permute(0, 3, 1, 2).float() / 255  # fmt: skip
    mean, std = torch.tensor(stats["mean"]).view(1, -1, 1, 1), torch.tensor(stats["std"]).view(1, -1, 1, 1)
    return (x - mean) / std, files


def masks_of(files: list[Path], size: tuple[int, int]) -> np.ndarray:
    """[N, H, W] bool: ground_truth/<defect>/<name>_mask.png of each test image, resized; normal images all False."""
    from PIL import Image

    out = np.zeros((len(files), *size), bool)
    for i, f in enumerate(files):
        mask = f.parents[2] / "ground_truth" / f.parent.name / f"{f.stem}_mask.png"
        if mask.is_file():
            out[i] = np.asarray(Image.open(mask).convert("L").resize(size[::-1], Image.NEAREST)) > 127
    return out


def pro(maps: np.ndarray, masks: np.ndarray, max_fpr: float = 0.3) -> float:
    """MVTec AD's per-region overlap integrated up to `max_fpr` and normalised, as `mae anomaly` reports it: at each
    distinct score, the mean over the masks' 8-connected regions of the share above it, against the share of normal
    pixels above it."""
    from scipy.ndimage import label

    regions, count = np.zeros(masks.shape, np.int64), 0
    for i, m in enumerate(masks):
        lab, n = label(m, structure=np.ones((3, 3)))
        regions[i], count = np.where(lab > 0, lab + count, 0), count + n
    sizes = np.bincount(regions.ravel(), minlength=count + 1)
    weight = np.where(regions > 0, 1.0 / (sizes[regions] * max(count, 1)), 0.0).ravel()
    order = np.argsort(-maps.ravel(), kind="stable")
    s, weight, neg = maps.ravel()[order], weight[order], (~masks).ravel()[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    fpr, overlap = np.r_[0.0, np.cumsum(neg)[last] / neg.sum()], np.r_[0.0, np.cumsum(weight)[last]]
    x = np.r_[fpr[fpr <= max_fpr], max_fpr]
    y = np.r_[overlap[fpr <= max_fpr], np.interp(max_fpr, fpr, overlap)]
    return float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2) / max_fpr)


def kinds_of(files: list[Path]) -> np.ndarray:
    """Each test image's folder: "good" or its defect's name."""
    return np.array([Path(f).parent.name for f in files])


def by_defect(scores: np.ndarray, kinds: np.ndarray) -> dict[str, float]:
    """Image AUROC of each defect kind's images against the normal ones."""
    out = {}
    for kind in sorted(set(kinds) - {"good"}):
        pick = (kinds == "good") | (kinds == kind)
        out[str(kind)] = auroc(scores[pick], kinds[pick] == kind)
    return out


def judge(scores: np.ndarray, maps: np.ndarray, kinds: np.ndarray, masks: np.ndarray) -> dict:
    return {"image_auroc": auroc(scores, kinds != "good"), "by_defect": by_defect(scores, kinds),
            "pixel_auroc": auroc(maps.ravel(), masks.ravel()), "pro": pro(maps, masks)}  # fmt: skip


def position_scores(train: torch.Tensor, test: torch.Tensor, model: mae.MaskedAutoencoder, shrinkage: float) -> tuple:
    """(scores [N], maps [N, H, W]) of [N, L, D] vectors, one per patch position: a Gaussian per position fitted to
    `train`'s, an image's score its mean distance over positions, its map the distances upsampled bilinearly to the
    input's size (as `mae anomaly` scores tokens)."""
    d = torch.stack([gaussian_distance(train[:, i], test[:, i], shrinkage) for i in range(train.shape[1])], 1)
    grid = d.view(len(d), 1, *model.grid_size)
    maps = torch.nn.functional.interpolate(grid, size=tuple(model.img_size), mode="bilinear", align_corners=False)
    return d.mean(1).numpy(), maps[:, 0].numpy()


def position_gaussian(train: torch.Tensor, test: torch.Tensor, model: mae.MaskedAutoencoder) -> tuple:
    """(scores [N], maps [N, H, W]): `position_scores` on raw pixel patches (PaDiM on pixels)."""
    return position_scores(model.patchify(train).float(), model.patchify(test).float(), model, 1e-2)


def pixel_baselines(run: Path, category: Path) -> dict:
    """A Gaussian per patch position on raw pixel patches, and PCA reconstruction error, both fitted to the normal
    training images at the model's input size and normalisation."""
    model = mae.load_pretrained(run).eval()
    stats = harness.run_config(run)["data"]
    train, _ = read(category / "train", model, stats)
    test, files = read(category / "test", model, stats)
    kinds = kinds_of(files)
    masks = masks_of(files, tuple(model.img_size))
    out = {"pixels: gaussian per patch position": judge(*position_gaussian(train, test, model), kinds, masks)}
    a, b = train.flatten(1), test.flatten(1)
    mu = a.mean(0)
    _, _, v = torch.linalg.svd(a - mu, full_matrices=False)
    basis = v[:PCA_COMPONENTS].T
    residual = ((b - mu) - (b - mu) @ basis @ basis.T).view_as(test).pow(2).mean(1)  # [N, H, W]
    out["pixels: PCA error"] = judge(residual.flatten(1).mean(1).numpy(), residual.numpy(), kinds, masks)
    return out


def anomaly_run(model: Path, category: Path, out: Path, seed: int) -> dict:
    """`mae anomaly` at its defaults (the training images given, as a random-init model has no run of its own)."""
    harness.stage("anomaly", out, pretrained=str(model), train_path=str(category / "train"), seed=seed,
                  data={"path": str(category / "test"), "num_workers": 0}, save_maps=False)  # fmt: skip
    m = json.loads((out / "metrics.json").read_text())
    with (out / "scores.csv").open() as f:
        rows = list(csv.DictReader(f))  # "class": the test image's folder, "good" or its defect
    scores, kinds = np.array([float(r["score"]) for r in rows]), np.array([r["class"] for r in rows])
    return {"image_auroc": m["auroc"], "by_defect": by_defect(scores, kinds), "pixel_auroc": m.get("pixel_auroc"),
            "pro": m.get("pixel_pro"), "choice": f"--score {m['score']} --features {m['features']}"}  # fmt: skip


def one_run(args: argparse.Namespace, category: Path, seed: int) -> dict:
    run = args.output / f"{category.name}_seed{seed}"
    change = QUICK if args.quick else {}
    minutes = harness.stage("pretrain", run, RECIPE, seed=seed, **harness.merge(
        change, {"data": {"path": str(category / "train")}, "loop": {"progress": False}})) / 60  # fmt: skip
    results = {"MAE: mae anomaly (defaults)": anomaly_run(run, category, run / "scores" / "default", seed)}
    twin = random_init(run, seed)
    results["random-init: mae anomaly (defaults)"] = anomaly_run(twin, category, run / "scores" / "random", seed)
    results |= pixel_baselines(run, category)
    return {"category": category.name, "seed": seed, "pretrain_minutes": minutes, "methods": results}


def table(runs: list[dict]) -> str:
    methods = list(runs[0]["methods"])
    lines = ["| method | image AUROC | pixel AUROC | PRO (FPR <= 0.3) |", "|---|---|---|---|"]
    for m in methods:
        cells = [np.mean([r["methods"][m][k] for r in runs]) * 100 for k in ("image_auroc", "pixel_auroc", "pro")]
        lines.append(f"| {m} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    lines += [""] + breakdown(runs, methods, "category", sorted({r["category"] for r in runs}))
    lines += [""] + breakdown(runs, methods, "defect", sorted(runs[0]["methods"][methods[0]]["by_defect"]))
    minutes = [r["pretrain_minutes"] for r in runs]
    lines.append(f"\nMeans over {len(runs)} runs (categories x seeds); pretraining {min(minutes):.1f}-"
                 f"{max(minutes):.1f} min a run on {harness.machine()}.")  # fmt: skip
    return "\n".join(lines)


def breakdown(runs: list[dict], methods: list[str], by: str, columns: list[str]) -> list[str]:
    """Image AUROC of each method for each category or defect kind, the mean over the runs (seeds) that have it."""

    def cell(method: str, column: str) -> float:
        if by == "category":
            return np.mean([r["methods"][method]["image_auroc"] for r in runs if r["category"] == column]) * 100
        return np.mean([r["methods"][method]["by_defect"][column] for r in runs]) * 100

    lines = [f"| image AUROC by {by} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    return lines + [f"| {m} | " + " | ".join(f"{cell(m, c):.1f}" for c in columns) + " |" for m in methods]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="a defect set in MVTec AD's layout, one folder a category")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--quick", action="store_true", help="one category, one seed, 2 epochs at 64 px")
    args = p.parse_args(argv)
    found = categories(args.data)
    if not found:
        p.error(f"--data {args.data}: no <category>/train/good and <category>/test folders")
    chosen, seeds = (found[:1], args.seeds[:1]) if args.quick else (found, args.seeds)
    runs = [one_run(args, c, s) for c in chosen for s in seeds]
    harness.report(args.output, "results", table(runs), {"machine": harness.machine(), "quick": args.quick,
                                                         "recipe": str(RECIPE.name), "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
