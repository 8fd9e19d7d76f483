"""The Fashion-MNIST one-class anomaly study (docs/anomaly.md): for each class, pretrain an MAE on that class's
6,000 training images only (recipes/anomaly/fashion_mnist_one_class.yaml), score all 10,000 test images, and
report the AUROC with that class as normal; mean over classes, per seed. Side by side on the same split: the
MAE's reconstruction score under every aggregate, and its encoder features' k-NN distance and Gaussian
(Mahalanobis) distance, on the whole image and on its masked views (`mae anomaly --features masked`); the same
feature scores from a random-init model of the same architecture; and on raw pixels the k-NN distance, the
Gaussian distance and PCA reconstruction error.

No choice is made on test images: a tenth of the class's training images (seeded) is held out of pretraining
and of every method's fit, and with as many images of the other classes' training images per normal one as
the test set has (9) it forms `val`. A method with a setting (the map's aggregate: mean, max, top 1/5/10%; the
Gaussian's shrinkage) is reported at the setting with the best mean val AUROC over classes and seeds, and the
MAE's score is the MAE method best on val (every number is kept in results.json).

    apt-get install -y dataset-fashion-mnist          # IDX files in /usr/share/datasets/fashion-mnist/
    python scripts/anomaly_study.py --output runs/anomaly_study                      # the full protocol
    python scripts/anomaly_study.py --classes 0 1 --seeds 0 --epochs 4 --output runs/anomaly_quick   # reduced
    python scripts/anomaly_study.py --output runs/anomaly_e192 \
        --override '{"model": {"embed_dim": 192, "num_heads": 3}, "loop": {"epochs": 30}}'   # a recipe lever
    python scripts/anomaly_study.py --keep docs/results/anomaly_study_p2 --table       # docs/anomaly.md's table

With `--keep DIR`, each class and seed's scores (and the CPU and minutes of its
pretraining) are also written there, and a class and seed found there is not run again: the documented study,
too long for one sitting on 2 cores, is completed on later machines, and a run over all 10 classes and seeds 0
and 1 writes its `results.json` there too. `--override` (a recipe lever on the whole protocol) and the recipe as
run (the run's config.yaml less what the study sets for each class and seed: recipe file and override together)
are recorded with each run's scores; runs of different recipes or epochs are never summarised together. With
`--rescore`, runs whose kept scores predate a method of this script are scored again, every method, from the
pretraining in `--output` (its minutes, CPU and override kept).

Public API only: `mae.pretrain`, `mae.load_pretrained` (through `mae.anomaly_maps.load_with_decoder`),
`mae.anomaly_maps`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from finetune_study import cpu  # noqa: E402  (the CPU's model and AVX-512 units, as the studies record it)
from prepare_fashion_mnist import CLASSES, DEBIAN, IDX, idx_file, read_idx  # noqa: E402

import mae  # noqa: E402
from mae.anomaly_maps import (  # noqa: E402
    aggregate,
    anomaly_maps,
    auroc,
    encoder_features,
    gaussian_distance,
    knn_distance,
    load_with_decoder,
    patch_tokens,
    position_distance,
)
from mae.run_folder import run_config  # noqa: E402

RECIPE = Path(__file__).parents[1] / "recipes" / "anomaly" / "fashion_mnist_one_class.yaml"
AGGREGATES = {"mean": ("mean", 100.0), "max": ("max", 100.0), "top1%": ("topk_mean", 1.0),
              "top5%": ("topk_mean", 5.0), "top10%": ("topk_mean", 10.0)}  # fmt: skip
SHRINKAGES = (1e-3, 1e-2, 1e-1)  # of the Gaussian's covariance, towards its mean variance
SETTING = " @ "  # "mae recon @ top1%": a method, and the setting chosen on val
K = 5  # neighbours of the k-NN scores
VAL_FRACTION = 0.1  # of the normal class's training images, held out of pretraining for choosing the aggregate
VAL_ANOMALIES_PER_NORMAL = 9  # as in the test set: 9,000 images of other classes beside 1,000 normal ones
PCA_COMPONENTS = 32
# A run's config less what the study sets for each class and seed and what does not change the result: the rest is
# the recipe it ran (recipe file and --override together), recorded with its scores.
PER_RUN = {"output_dir", "seed", "resume", "data.path", "data.mean", "data.std", "data.num_workers", "loop.progress",
           "loop.log_every", "loop.log_with", "loop.checkpoint_every", "loop.keep_checkpoints"}  # fmt: skip
# The study's methods: 1, the first; 2, with the Gaussian per patch position. Bumped with each method added, so that
# --rescore scores the runs kept before it again (their pretraining kept) and no others: a stopped rescore resumes.
SCORING = 2
MASKED_VIEWS = 4  # `encoder_features`' masks for the masked views: the maps' 4 sets


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


def in_batches(fn, x: torch.Tensor, batch: int = 500, dim: int = 0) -> torch.Tensor:
    """`fn` over `x` a batch at a time (10,000 test images at once would not fit in memory), concatenated along
    `fn`'s image dimension `dim`."""
    return torch.cat([fn(x[i : i + batch]) for i in range(0, len(x), batch)], dim)


@torch.no_grad()
def model_scores(model, bank_x: torch.Tensor, query_x: torch.Tensor, seed: int, maps: bool, batch: int = 500) -> dict:
    """The feature scores of `query_x` against `bank_x` (k-NN; Gaussian at each shrinkage), on the whole images'
    features and on their masked views'; a Gaussian per patch position (`position_distance`, averaged over
    positions) at each shrinkage; and, with `maps`, the reconstruction score under every aggregate."""
    model.eval()
    scores = {}
    if maps:
        error = in_batches(lambda x: anomaly_maps(model, x, masks=4, seed=seed)[0], query_x, batch)
        scores = {f"recon{SETTING}{name}": aggregate(error, how, top) for name, (how, top) in AGGREGATES.items()}
    bank, query = (in_batches(lambda b: patch_tokens(model, b), x, batch) for x in (bank_x, query_x))
    scores |= feature_scores(bank.mean(1), query.mean(1), "features")  # `encoder_features` of the whole image
    scores |= {f"gaussian positions{SETTING}{s:g}": position_distance(bank, query, s).mean(1) for s in SHRINKAGES}
    bank = in_batches(lambda x: encoder_features(model, x, MASKED_VIEWS, seed), bank_x, batch)
    query = in_batches(lambda x: encoder_features(model, x, MASKED_VIEWS, seed), query_x, batch)
    return scores | feature_scores(bank, query, "masked features")


def feature_scores(bank: torch.Tensor, query: torch.Tensor, what: str) -> dict:
    scores = {f"knn {what}": knn_distance(bank, query, K)}
    return scores | {f"gaussian {what}{SETTING}{s:g}": gaussian_distance(bank, query, s) for s in SHRINKAGES}


def baselines(train: np.ndarray, query: np.ndarray) -> dict:
    """On raw pixels: k-NN cosine distance, Gaussian distance, PCA reconstruction error (fitted on the normal class)."""
    a, b = torch.from_numpy(train).float().flatten(1) / 255, torch.from_numpy(query).float().flatten(1) / 255
    mu = a.mean(0)
    _, _, v = torch.linalg.svd(a - mu, full_matrices=False)
    basis = v[:PCA_COMPONENTS].T
    centred = b - mu
    residual = centred - centred @ basis @ basis.T
    return feature_scores(a, b, "raw pixels") | {"pca error": residual.pow(2).sum(1)}


def split(train_x: np.ndarray, train_y: np.ndarray, c: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fit, val images, val anomalous): a seeded tenth of class c's training images held out, and beside it
    VAL_ANOMALIES_PER_NORMAL times as many of the other classes' training images."""
    rng = np.random.default_rng([seed, c])
    normal, other = np.flatnonzero(train_y == c), np.flatnonzero(train_y != c)
    normal = rng.permutation(normal)
    held = max(1, round(len(normal) * VAL_FRACTION))
    anomalies = rng.choice(other, size=min(len(other), held * VAL_ANOMALIES_PER_NORMAL), replace=False)
    val = np.concatenate([normal[:held], anomalies])
    return train_x[np.sort(normal[held:])], train_x[val], np.r_[np.zeros(held, bool), np.ones(len(anomalies), bool)]


def recipe_change(text: str) -> dict:
    """A change of the recipe as `mae.pretrain` takes it, a JSON object of recipe sections (this script's --override,
    anomaly_levers.py's --variant): ValueError if `text` is not JSON, TypeError if not an object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise TypeError("not an object")
    return value


def pretrain_class(folder: Path, run: Path, seed: int, change: dict) -> None:
    """`mae.pretrain` of the recipe with `change` (a recipe_change) on one class's folder into `run`: the change's
    sections merged with what the study sets per class and seed (data.path, output_dir, seed), which it may not set;
    mae.MaeError if it tries to, or if the recipe's options refuse it."""
    data = change.get("data", {})
    if not isinstance(data, dict):
        raise mae.MaeError(
            'data: not an object; give the data section\'s options as one, e.g. {"data": {"hflip": false}}'
        )
    own = {"output_dir": str(run), "seed": seed}
    taken = [k for k in own if k in change] + ["data.path"] * ("path" in data)
    if taken:
        raise mae.MaeError(f"sets {', '.join(taken)}, which the study sets for each class and seed; leave it out")
    mae.pretrain(config=str(RECIPE), **{**change, **own, "data": {**data, "path": str(folder)}})


def one_class(args, c: int, seed: int, data: dict) -> dict:
    """{"val": {method: AUROC}, "test": {method: AUROC}, "pretrain minutes": m, "epochs": e, "cpu": ...} for class
    c as normal; kept in the run's `study_scores.json` (and in `--keep`), so a stopped study resumes at the class it
    was in (delete both to score anew)."""
    run = args.output / f"class{c}_seed{seed}"
    kept = args.keep / f"class{c}_seed{seed}.json" if args.keep else None
    earlier = None
    for done in (kept, run / "study_scores.json"):
        if done is not None and done.exists():
            try:
                earlier = json.loads(done.read_text())
            except ValueError as e:
                sys.exit(f"{done}: not a class's kept scores ({e}); delete it to run that class and seed again")
            break
    if earlier is not None and not (args.rescore and earlier.get("scoring", 1) < SCORING):
        return earlier
    if earlier is not None and not (run / "encoder.safetensors").exists():
        sys.exit(f"--rescore: {run} holds no pretraining to score again; give the --output that does (scores of "
                 f"class {c}, seed {seed} kept in {done})")  # fmt: skip
    if not data:  # read on the first class that needs it: kept scores need no data
        data.update({part: load_split(args.source, part) for part in ("train", "test")})
    (train_x, train_y), (test_x, test_y) = data["train"], data["test"]
    fit, val_x, val_anomalous = split(train_x, train_y, c, seed)
    query = np.concatenate([val_x, test_x])  # scored in one pass: the fit's features and PCA computed once
    parts = {"val": (slice(0, len(val_x)), val_anomalous), "test": (slice(len(val_x), None), test_y != c)}
    folder = write_class_folder(fit, args.output / "classes" / f"{c}_seed{seed}")
    if not (run / "encoder.safetensors").exists():
        t = time.time()
        try:
            pretrain_class(folder, run, seed, args.override)
        except mae.MaeError as e:  # e.g. an --override the recipe's options refuse: one line, nothing scored
            sys.exit(f"--override {json.dumps(args.override)}: {e}" if args.override else str(e))
        (run / "pretrain_minutes").write_text(f"{(time.time() - t) / 60:.2f}")  # kept for a rerun of the study
    # The pretraining's record (its minutes, CPU and override): a rescore keeps the earlier one's, the same run's.
    if earlier is None:
        made = {"pretrain minutes": float((run / "pretrain_minutes").read_text()), "cpu": cpu()}
        made |= {"override": args.override} if args.override else {}
    else:
        made = {k: earlier[k] for k in ("pretrain minutes", "cpu", "override") if k in earlier}
    config = run_config(run)
    stats = config["data"]
    model = load_with_decoder(run)
    bank_x, query_x = as_input(fit, stats["mean"], stats["std"]), as_input(query, stats["mean"], stats["std"])
    scores = {}
    for name, m in (("mae", model), ("random-init", random_like(run, seed))):  # a random decoder's maps: noise
        scores.update({f"{name} {k}": v for k, v in model_scores(m, bank_x, query_x, seed, name == "mae").items()})
    scores.update(baselines(fit, query))
    # The recipe as pretrained (recipe file and override together): runs of a recipe file edited between them are
    # told apart though their overrides agree.
    result: dict = {"epochs": config["loop"]["epochs"], "recipe": recipe_of(config), **made, "scoring": SCORING}
    if earlier is not None:
        result["rescored on"] = cpu()
    for part, (rows, anomalous) in parts.items():
        result[part] = {k: auroc(v[rows].numpy(), anomalous) for k, v in scores.items()}
    print(f"class {c} ({CLASSES[c]}), seed {seed}, {made['pretrain minutes']:.1f} min pretraining; test AUROC: "
          + ", ".join(f"{k} {v:.4f}" for k, v in result["test"].items()), flush=True)  # fmt: skip
    for path in (run / "study_scores.json", kept):
        if path is not None:
            write_whole(path, json.dumps(result, indent=1))
    return result


def recipe_of(config: dict, prefix: str = "") -> dict:
    """The run's config (run_config) less PER_RUN: the recipe it ran."""
    return {
        k: recipe_of(v, f"{prefix}{k}.") if isinstance(v, dict) else v
        for k, v in config.items()
        if prefix + k not in PER_RUN
    }


def write_whole(path: Path, text: str) -> None:
    """Written whole or not at all: a kill here never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# The study's methods as docs/anomaly.md's tables name and order them (a method not named here is left out).
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
    """docs/anomaly.md's table of a study's results.json: test AUROC in percent, each method at its setting chosen on
    val; per class the mean over seeds, each seed's mean over classes, their mean and (val); the MAE's score bold."""
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


def choose(summary: dict) -> dict:
    """{method: its score as reported}: each method at its setting with the best mean val AUROC, and "mae" for
    the best of the MAE's methods on val (its score in the study)."""
    val = summary["val"]["mean over seeds"]
    chosen: dict = {}
    for m in val:
        family = m.split(SETTING)[0]  # "mae recon @ top1%" -> "mae recon"
        if family not in chosen or val[m] > val[chosen[family]]:
            chosen[family] = m
    ours = [m for f, m in chosen.items() if f.startswith("mae ")]
    if ours:
        chosen["mae"] = max(ours, key=lambda m: val[m])
    return chosen


def random_like(run: Path, seed: int):
    """The run's architecture with fresh weights (seeded): what the pretraining adds over none."""
    cfg = run_config(run)["model"]  # the run's, so that a recipe lever changing the architecture changes it here too
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "masking", "grad_checkpointing") and v is not None}
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
    parser.add_argument("--keep", type=Path, default=None,
                        help="also keep each class and seed's scores here, and take them from here when present: a "
                        "study over machines (docs/results/anomaly_study_p2: the recipe's)")  # fmt: skip
    parser.add_argument("--rescore", action="store_true",
                        help="score kept runs again where their scores predate a method of this script (their "
                        "pretraining in --output kept): every method on the same runs")  # fmt: skip
    parser.add_argument("--override", default="{}", metavar="JSON",
                        help="a change of the recipe, as mae.pretrain takes it (a recipe lever measured on the whole "
                        "protocol), e.g. '{\"model\": {\"depth\": 4}}'; recorded with each run's scores")  # fmt: skip
    parser.add_argument("--table", action="store_true",
                        help="print docs/anomaly.md's table of the kept study's results.json (--keep, else --output) "
                        "and exit")  # fmt: skip
    args = parser.parse_args()
    if args.table:
        kept = (args.keep or args.output) / "results.json"
        if not kept.exists():
            parser.exit(2, f"--table: {kept} does not exist; run the study first (a --keep folder gets it once all 10 "
                        "classes and both seeds are kept)\n")  # fmt: skip
        try:
            print(table(json.loads(kept.read_text())))
        except (ValueError, KeyError, TypeError) as e:
            parser.exit(2, f"--table: {kept} is not a study's results.json ({e!r}); run the study again to write it\n")
        return
    try:
        args.override = recipe_change(args.override)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"--override {args.override!r}: {e}; give a JSON object of recipe sections, e.g. "
                    '\'{"loop": {"epochs": 40}}\'\n')  # fmt: skip
    if args.epochs:
        args.override.setdefault("loop", {})["epochs"] = args.epochs
    data: dict = {}
    results = {f"{c}/{s}": one_class(args, c, s, data) for s in args.seeds for c in args.classes}
    epochs = {r.get("epochs") for r in results.values()}
    # A recipe: the override and the whole recipe as run (runs kept before it was recorded have none).
    recipes = {json.dumps({"override": r.get("override", {}), "recipe": r.get("recipe")}, sort_keys=True)
               for r in results.values()}  # fmt: skip
    if len(epochs) > 1 or len(recipes) > 1:
        where = f"--keep {args.keep}" if args.keep else f"--output {args.output}"
        what = f"epochs ({sorted(map(str, epochs))})" if len(epochs) > 1 else f"recipes ({sorted(recipes)})"
        sys.exit(f"{where}: its runs were pretrained for different {what}: keep one protocol per folder")
    methods = [m for m in next(iter(results.values()))["test"] if all(m in r["test"] for r in results.values())]
    missing = sorted({m for r in results.values() for m in r["test"]} - set(methods))
    if missing:  # kept scores from before a method was added: the study is judged on those every run has
        print(f"not in every run's scores, left out of the summary: {', '.join(missing)}", file=sys.stderr)
    summary: dict = {}
    for part in ("val", "test"):
        summary[part] = {f"seed {s}": {m: float(np.mean([results[f"{c}/{s}"][part][m] for c in args.classes]))
                                       for m in methods} for s in args.seeds}  # fmt: skip
        summary[part]["mean over seeds"] = {m: float(np.mean([v[m] for v in summary[part].values()])) for m in methods}
    chosen = choose(summary)
    protocol = {"classes": args.classes, "seeds": args.seeds, "epochs": epochs.pop(),
                **json.loads(recipes.pop()), "val_fraction": VAL_FRACTION,
                "val_anomalies_per_normal": VAL_ANOMALIES_PER_NORMAL}  # fmt: skip
    report = {"protocol": protocol, "per_run": results, "summary": summary, "chosen_on_val": chosen}
    # Only the whole protocol (every class, at least the default seeds) writes the kept study's summary: a run over
    # some classes or one seed would overwrite it with a part of it.
    whole = set(args.classes) == set(range(len(CLASSES))) and set(args.seeds) >= set(parser.get_default("seeds"))
    for folder in (args.output, args.keep if whole else None):
        if folder is not None:
            write_whole(folder / "results.json", json.dumps(report, indent=1))
    print(f"\nmean AUROC over classes {args.classes}, test (val), each seed and their mean; settings chosen on val:")
    for family, m in chosen.items():
        cells = [f"{summary['test'][k][m]:.4f} ({summary['val'][k][m]:.4f})" for k in summary["test"]]
        print(f"  {family:28s} {m.removeprefix(family).removeprefix(SETTING) or '':10s} " + "  ".join(cells))
    test = summary["test"]["mean over seeds"]
    best = max((m for f, m in chosen.items() if not f.startswith("mae")), key=lambda m: test[m])
    print(
        f"\nthe MAE's score (best on val): {chosen['mae']}, test {test[chosen['mae']]:.4f}; the best baseline on "
        f"test: {best}, {test[best]:.4f}; difference {100 * (test[chosen['mae']] - test[best]):+.2f} points"
    )


if __name__ == "__main__":
    main()
