"""The Fashion-MNIST one-class anomaly study (docs/results/anomaly.md): for each class, pretrain an MAE
on that class's 6,000 training images only (recipes/anomaly/fashion_mnist_one_class.yaml), score all 10,000 test
images, and report the AUROC with that class as normal; mean over classes, per seed. Side by side on the same split: the
MAE's reconstruction score under every aggregate, and its encoder features' k-NN distance and Gaussian
(Mahalanobis) distance, on the whole image and on its masked views, and its Gaussian per patch position (each a
`mae.anomaly` run: `--score`, `--features`, `--aggregate`, `--shrinkage`); the same feature scores from a
random-init model of the same architecture; and on raw pixels the k-NN distance, the Gaussian distance and PCA
reconstruction error.

No choice is made on test images: a tenth of the class's training images (seeded) is held out of pretraining
and of every method's fit, and with as many images of the other classes' training images per normal one as
the test set has (9) it forms `val`. A method with a setting (the map's aggregate: mean, max, top 1/5/10%; the
Gaussian's shrinkage) is reported at the setting with the best mean val AUROC over classes and seeds, and the
MAE's score is the MAE method best on val (every number is kept in results.json). From the repository root:

    apt-get install -y dataset-fashion-mnist          # IDX files in /usr/share/datasets/fashion-mnist/
    python scripts/prepare_fashion_mnist.py --output data/fashion_mnist
    python -m studies.anomaly --output runs/anomaly_study                        # the full protocol
    python -m studies.anomaly --classes 0 1 --seeds 0 --epochs 4 --output runs/anomaly_quick   # reduced
    python -m studies.anomaly --output runs/anomaly_e192 \
        --override '{"model": {"embed_dim": 192, "num_heads": 3}, "loop": {"epochs": 30}}'   # a recipe lever
    python -m studies.anomaly --keep docs/results/anomaly_study_p2 --table     # docs/results/anomaly.md's table

With `--keep DIR`, each class and seed's scores (and the CPU and minutes of its pretraining) are also written
there, and a class and seed found there (its own file, or the kept study's results.json) is not run again: the
documented study, too long for one sitting on 2 cores, is completed on later machines, and a run over all 10
classes and seeds 0 and 1 writes its `results.json` there too. `--override` (a recipe lever on the whole protocol)
and the recipe as run (the run's config.yaml less what the study sets for each class and seed: recipe file and
override together) are recorded with each run's scores; runs of different recipes or epochs are never summarised
together. With `--rescore`, runs whose kept scores predate a method of this study are scored again, every method,
from the pretraining in `--output` (its minutes, CPU and override kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import mae
from studies import harness
from studies.anomaly_scores import CLASSES, SCORING, SETTING, auroc, model_scores, pixel_scores, table

RECIPE = harness.RECIPES / "anomaly" / "fashion_mnist_one_class.yaml"
VAL_FRACTION = 0.1  # of the normal class's training images, held out of pretraining for choosing the aggregate
VAL_ANOMALIES_PER_NORMAL = 9  # as in the test set: 9,000 images of other classes beside 1,000 normal ones
# A run's config less what the study sets for each class and seed and what does not change the result: the rest is
# the recipe it ran (recipe file and --override together), recorded with its scores.
PER_RUN = {"output_dir", "seed", "resume", "data.path", "data.mean", "data.std", "data.num_workers", "loop.progress",
           "loop.log_every", "loop.log_with", "loop.checkpoint_every", "loop.keep_checkpoints"}  # fmt: skip


def write_folder(images: np.ndarray, folder: Path) -> Path:
    """The images as PNG files NNNNN.png (their row), once: a `done` file marks a folder written whole."""
    from PIL import Image

    if not (folder / "done").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            Image.fromarray(img).save(folder / f"{i:05d}.png")
        (folder / "done").touch()
    return folder


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
    """A change of the recipe as `mae.pretrain` takes it, a JSON object of recipe sections (--override): ValueError
    if `text` is not JSON, TypeError if not an object."""
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


def kept_scores(args: argparse.Namespace, c: int, seed: int) -> tuple[dict | None, Path | None]:
    """(the scores kept for class c and seed, the file they came from), or (None, None): from --keep (the class's
    file, else the kept study's results.json), else the run folder's study_scores.json."""
    run, key = args.output / f"class{c}_seed{seed}", f"{c}/{seed}"
    keep = [args.keep / f"class{c}_seed{seed}.json", args.keep / "results.json"] if args.keep else []
    for done in (*keep, run / "study_scores.json"):
        if not done.exists():
            continue
        try:
            found = json.loads(done.read_text())
        except ValueError as e:
            sys.exit(f"{done}: not a class's kept scores ({e}); delete it to run that class and seed again")
        if done.name != "results.json":
            return found, done
        if key in found.get("per_run", {}):
            return found["per_run"][key], done
    return None, None


def pretrained_run(args: argparse.Namespace, c: int, seed: int, fit: np.ndarray) -> tuple[Path, Path]:
    """(the class's pretraining run, its fit folder): pretrained once (its minutes kept beside it)."""
    run = args.output / f"class{c}_seed{seed}"
    folder = write_folder(fit, args.output / "classes" / f"{c}_seed{seed}")
    if not (run / "encoder.safetensors").exists():
        t = time.time()
        try:
            pretrain_class(folder, run, seed, args.override)
        except mae.MaeError as e:  # e.g. an --override the recipe's options refuse: one line, nothing scored
            sys.exit(f"--override {json.dumps(args.override)}: {e}" if args.override else str(e))
        (run / "pretrain_minutes").write_text(f"{(time.time() - t) / 60:.2f}")  # kept for a rerun of the study
    return run, folder


def one_class(args: argparse.Namespace, c: int, seed: int, data: dict) -> dict:
    """{"val": {method: AUROC}, "test": {method: AUROC}, "pretrain minutes": m, "epochs": e, "cpu": ...} for class
    c as normal; kept in the run's `study_scores.json` (and in `--keep`), so a stopped study resumes at the class it
    was in (delete both to score anew)."""
    earlier, done = kept_scores(args, c, seed)
    if earlier is not None and not (args.rescore and earlier.get("scoring", 1) < SCORING):
        return earlier
    run = args.output / f"class{c}_seed{seed}"
    if earlier is not None and not (run / "encoder.safetensors").exists():
        sys.exit(f"--rescore: {run} holds no pretraining to score again; give the --output that does (scores of "
                 f"class {c}, seed {seed} kept in {done})")  # fmt: skip
    if not data:  # read on the first class that needs it: kept scores need no data
        data.update({part: harness.load_split(args.data, part) for part in ("train", "test")})
    (train_x, train_y), (test_x, test_y) = data["train"], data["test"]
    fit, val_x, val_anomalous = split(train_x, train_y, c, seed)
    run, folder = pretrained_run(args, c, seed, fit)
    # The pretraining's record (its minutes, CPU and override): a rescore keeps the earlier one's, the same run's.
    if earlier is None:
        made = {"pretrain minutes": float((run / "pretrain_minutes").read_text()), "cpu": harness.cpu()}
        made |= {"override": args.override} if args.override else {}
    else:
        made = {k: earlier[k] for k in ("pretrain minutes", "cpu", "override") if k in earlier}
    query = np.concatenate([val_x, test_x])  # scored in one pass: the fit's features computed once per setting
    parts = {"val": (slice(0, len(val_x)), val_anomalous), "test": (slice(len(val_x), None), test_y != c)}
    queries = write_folder(query, args.output / "classes" / f"{c}_seed{seed}_query")
    scores = model_scores(run, folder, queries, len(query), seed)
    scores.update(pixel_scores(fit, query))
    config = harness.run_config(run)
    # The recipe as pretrained (recipe file and override together): runs of a recipe file edited between them are
    # told apart though their overrides agree.
    result: dict = {"epochs": config["loop"]["epochs"], "recipe": recipe_of(config), **made, "scoring": SCORING}
    if earlier is not None:
        result["rescored on"] = harness.cpu()
    for part, (rows, anomalous) in parts.items():
        result[part] = {k: auroc(v[rows], anomalous) for k, v in scores.items()}
    print(f"class {c} ({CLASSES[c]}), seed {seed}, {made['pretrain minutes']:.1f} min pretraining; test AUROC: "
          + ", ".join(f"{k} {v:.4f}" for k, v in result["test"].items()), flush=True)  # fmt: skip
    for path in (run / "study_scores.json", args.keep / f"class{c}_seed{seed}.json" if args.keep else None):
        if path is not None:
            harness.write_whole(path, json.dumps(result, indent=1))
    return result


def recipe_of(config: dict, prefix: str = "") -> dict:
    """The run's config (config.yaml) less PER_RUN: the recipe it ran."""
    return {
        k: recipe_of(v, f"{prefix}{k}.") if isinstance(v, dict) else v
        for k, v in config.items()
        if prefix + k not in PER_RUN
    }


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


def one_protocol(args: argparse.Namespace, results: dict) -> dict:
    """The protocol every run shares (epochs, override and recipe); the study ends with one line if they differ."""
    epochs = {r.get("epochs") for r in results.values()}
    # A recipe: the override and the whole recipe as run (runs kept before it was recorded have none).
    recipes = {json.dumps({"override": r.get("override", {}), "recipe": r.get("recipe")}, sort_keys=True)
               for r in results.values()}  # fmt: skip
    if len(epochs) > 1 or len(recipes) > 1:
        where = f"--keep {args.keep}" if args.keep else f"--output {args.output}"
        what = f"epochs ({sorted(map(str, epochs))})" if len(epochs) > 1 else f"recipes ({sorted(recipes)})"
        sys.exit(f"{where}: its runs were pretrained for different {what}: keep one protocol per folder")
    return {"classes": args.classes, "seeds": args.seeds, "epochs": epochs.pop(), **json.loads(recipes.pop()),
            "val_fraction": VAL_FRACTION, "val_anomalies_per_normal": VAL_ANOMALIES_PER_NORMAL}  # fmt: skip


def summarise(args: argparse.Namespace, results: dict) -> dict:
    """The study's report: protocol, every run's scores, the mean AUROC of each method and the settings chosen."""
    protocol = one_protocol(args, results)
    methods = [m for m in next(iter(results.values()))["test"] if all(m in r["test"] for r in results.values())]
    missing = sorted({m for r in results.values() for m in r["test"]} - set(methods))
    if missing:  # kept scores from before a method was added: the study is judged on those every run has
        print(f"not in every run's scores, left out of the summary: {', '.join(missing)}", file=sys.stderr)
    summary: dict = {}
    for part in ("val", "test"):
        summary[part] = {f"seed {s}": {m: float(np.mean([results[f"{c}/{s}"][part][m] for c in args.classes]))
                                       for m in methods} for s in args.seeds}  # fmt: skip
        summary[part]["mean over seeds"] = {m: float(np.mean([v[m] for v in summary[part].values()])) for m in methods}
    return {"protocol": protocol, "per_run": results, "summary": summary, "chosen_on_val": choose(summary)}


def print_summary(report: dict) -> None:
    summary, chosen = report["summary"], report["chosen_on_val"]
    classes = report["protocol"]["classes"]
    print(f"\nmean AUROC over classes {classes}, test (val), each seed and their mean; settings chosen on val:")
    for family, m in chosen.items():
        cells = [f"{summary['test'][k][m]:.4f} ({summary['val'][k][m]:.4f})" for k in summary["test"]]
        print(f"  {family:28s} {m.removeprefix(family).removeprefix(SETTING) or '':10s} " + "  ".join(cells))
    test = summary["test"]["mean over seeds"]
    best = max((m for f, m in chosen.items() if not f.startswith("mae")), key=lambda m: test[m])
    print(
        f"\nthe MAE's score (best on val): {chosen['mae']}, test {test[chosen['mae']]:.4f}; the best baseline on "
        f"test: {best}, {test[best]:.4f}; difference {100 * (test[chosen['mae']] - test[best]):+.2f} points"
    )


def print_table(parser: argparse.ArgumentParser, folder: Path) -> None:
    kept = folder / "results.json"
    if not kept.exists():
        parser.exit(2, f"--table: {kept} does not exist; run the study first (a --keep folder gets it once all 10 "
                    "classes and both seeds are kept)\n")  # fmt: skip
    try:
        print(table(json.loads(kept.read_text())))
    except (ValueError, KeyError, TypeError) as e:
        parser.exit(2, f"--table: {kept} is not a study's results.json ({e!r}); run the study again to write it\n")


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/fashion_mnist"),
                        help="scripts/prepare_fashion_mnist.py's output (its train and test splits)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("runs/anomaly_study"))
    parser.add_argument("--classes", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=None, help="shorten the recipe (a reduced protocol)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="also keep each class and seed's scores here, and take them from here when present: a "
                        "study over machines (docs/results/anomaly_study_p2: the recipe's)")  # fmt: skip
    parser.add_argument("--rescore", action="store_true",
                        help="score kept runs again where their scores predate a method of this study (their "
                        "pretraining in --output kept): every method on the same runs")  # fmt: skip
    parser.add_argument("--override", default="{}", metavar="JSON",
                        help="a change of the recipe, as mae.pretrain takes it (a recipe lever measured on the whole "
                        "protocol), e.g. '{\"model\": {\"depth\": 4}}'; recorded with each run's scores")  # fmt: skip
    parser.add_argument("--table", action="store_true",
                        help="print docs/results/anomaly.md's table of the kept study's results.json (--keep, else "
                        "--output) and exit")  # fmt: skip
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse(argv)
    if args.table:
        return print_table(parser, args.keep or args.output)
    try:
        args.override = recipe_change(args.override)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"--override {args.override!r}: {e}; give a JSON object of recipe sections, e.g. "
                    '\'{"loop": {"epochs": 40}}\'\n')  # fmt: skip
    if args.epochs:
        args.override.setdefault("loop", {})["epochs"] = args.epochs
    data: dict = {}
    results = {f"{c}/{s}": one_class(args, c, s, data) for s in args.seeds for c in args.classes}
    report = summarise(args, results)
    # Only the whole protocol (every class, at least the default seeds) writes the kept study's summary: a run over
    # some classes or one seed would overwrite it with a part of it.
    whole = set(args.classes) == set(range(len(CLASSES))) and set(args.seeds) >= set(parser.get_default("seeds"))
    for folder in (args.output, args.keep if whole else None):
        if folder is not None:
            harness.write_whole(folder / "results.json", json.dumps(report, indent=1))
    print_summary(report)


if __name__ == "__main__":
    main()
