"""Does starting from another domain's MAE beat pretraining from scratch? Continued pretraining (`mae pretrain
--init`) measured on pairs of 28-px grayscale sets: Fashion-MNIST -> MNIST and MNIST -> Fashion-MNIST.

For each seed and pair SOURCE -> TARGET, every encoder pretrained with recipes/fashion_mnist/pretrain.yaml (its
architecture, 14 epochs at full budget), labels unused:

- `scratch_full`: from scratch on TARGET's 60,000 training images at the recipe's full budget (the run
  `pretrain_TARGET` of scripts/finetune_study.py: point --out at its folder and it is reused);
- `scratch_third`: from scratch on TARGET at a third of it (`--epochs` 5 of 14, the warm-up 1 epoch);
- `continue_third`: from SOURCE's full-budget encoder and decoder (`--init`), recipes/pretrain/continue.yaml, the
  same third;
- `source_only`: SOURCE's encoder as it is, no pretraining on TARGET (what `--init` starts from).

Each is scored on TARGET's 10,000 test images by the linear probe and k-NN of recipes/fashion_mnist/ (trained on
TARGET's training images): OUT/continue.json and OUT/continue.md. A stage that finished is not run again.

`--select` measures the continue recipe's choices instead (learning rate, warm-up, mask ratio at the third's
budget), from the seed-0 Fashion-MNIST encoder onto MNIST's `fit` split, probe top-1 on `val`: no test image.

    python scripts/finetune_study.py --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft  # or not
    python scripts/continue_study.py --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft --select
    python scripts/continue_study.py --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fashion_mnist_study import last_eval, mae_stage  # noqa: E402
from finetune_study import cpu  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "pretrain" / "continue.yaml"
THIRD = ["--loop.epochs", "5", "--optim.warmup_epochs", "1"]  # a third of the recipe's 14 epochs (36%)
PAIRS = (("fashion_mnist", "mnist"), ("mnist", "fashion_mnist"))
NAMES = {"fashion_mnist": "Fashion-MNIST", "mnist": "MNIST"}
# --select: the continue recipe's candidates, each against the from-scratch recipe's lr (blr 1.5e-3)
CANDIDATES = {
    "blr1.5e-3_wu1": ["--optim.blr", "1.5e-3", "--optim.warmup_epochs", "1"],
    "blr5e-4_wu1": ["--optim.blr", "5e-4", "--optim.warmup_epochs", "1"],
    "blr1.5e-4_wu1": ["--optim.blr", "1.5e-4", "--optim.warmup_epochs", "1"],
    "blr5e-4_wu0": ["--optim.blr", "5e-4", "--optim.warmup_epochs", "0"],
    "blr5e-4_wu1_mask0.6": ["--optim.blr", "5e-4", "--optim.warmup_epochs", "1", "--model.mask_ratio", "0.6"],
}


def stage(name: str, run: Path, *options: str) -> float:
    """`mae NAME` into the folder `run`, logged to RUN.log (appended, not with_suffix: run names may hold dots)."""
    return mae_stage(name, run.parent / f"{run.name}.log", "--output_dir", str(run), *options)


def pretrain(run: Path, data: Path, seed: int, *options: str) -> float:
    return stage("pretrain", run, "--data.path", str(data), "--seed", str(seed), "--loop.progress", "false", *options)


def scores(encoder: Path, train: Path, test: Path, out: Path, seed: int) -> dict:
    """Linear probe and k-NN top-1 (%) of `encoder` on (train, test), the last evaluation of each; runs in `out`."""
    r = {}
    for name in ("linprobe", "knn"):
        run = out / f"{encoder.name}_{name}"
        stage(name, run, "--pretrained", str(encoder), "--data.path", str(train), "--data.val_path", str(test),
              "--seed", str(seed), "--loop.progress", "false")  # fmt: skip
        r[name] = round(last_eval(run)["top1"], 2)
    return r


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    out = Path(args.out) / f"seed{seed}"
    data = {"fashion_mnist": Path(args.fashion_mnist), "mnist": Path(args.mnist)}
    r: dict = {"seed": seed, "seconds": {}}
    for name, root in data.items():  # the full-budget encoders: the targets' scratch_full and the sources
        r["seconds"][f"pretrain_{name}"] = pretrain(out / f"pretrain_{name}", root / "train", seed)
    for source, target in PAIRS:
        pair = f"{source}_to_{target}"
        train, test = data[target] / "train", data[target] / "test"
        runs = {
            "scratch_full": out / f"pretrain_{target}",
            "scratch_third": out / f"pretrain_{target}_third",
            "continue_third": out / f"continue_{pair}",
            "source_only": out / f"pretrain_{source}",
        }
        r["seconds"][runs["scratch_third"].name] = pretrain(runs["scratch_third"], train, seed, *THIRD)
        r["seconds"][runs["continue_third"].name] = pretrain(
            runs["continue_third"], train, seed, "--config", str(RECIPE), *THIRD[:2],
            "--init", str(runs["source_only"]),
        )  # fmt: skip
        r[pair] = {k: scores(run, train, test, out / f"eval_{target}", seed) for k, run in runs.items()}
    return r


def select(args: argparse.Namespace) -> None:
    """The continue recipe's choices on MNIST fit -> val, from the seed-0 Fashion-MNIST encoder."""
    out = Path(args.out) / "select_continue"
    mn = Path(args.mnist)
    source = Path(args.out) / "seed0" / "pretrain_fashion_mnist"
    pretrain(source, Path(args.fashion_mnist) / "train", 0)
    runs = {"scratch_third": THIRD}  # first: what every candidate has to beat
    runs |= {name: [*THIRD[:2], *options, "--init", str(source)] for name, options in CANDIDATES.items()}
    rows = {}
    for name, options in runs.items():
        seconds = pretrain(out / name, mn / "fit", 0, *options)
        rows[name] = {**scores(out / name, mn / "fit", mn / "val", out / "eval", 0), "minutes": round(seconds / 60, 1)}
        print(name, rows[name], flush=True)
    lines = [f"MNIST fit -> val top-1 (%), continued from the seed-0 Fashion-MNIST encoder at a third of the budget "
             f"(5 epochs); {cpu()}.", "", "| run | linear probe | k-NN | minutes |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v['linprobe']:.2f} | {v['knn']:.2f} | {v['minutes']} |" for k, v in rows.items()]
    (out / "select.json").write_text(json.dumps({"cpu": cpu(), "rows": rows}, indent=1))
    (out / "select.md").write_text("\n".join(lines) + "\n")
    print((out / "select.md").read_text())


def table(results: list[dict], machine: str) -> str:
    lines = [
        f"Test top-1 (%) on the target's 10,000 test images, linear probe / k-NN (k=20); {machine}.",
        "Full budget: recipes/fashion_mnist/pretrain.yaml (14 epochs); a third: 5 epochs.",
        "",
        "| source -> target | seed | source only | scratch, full | scratch, a third | continued, a third | "
        "continued - scratch (a third), probe |",
        "|---|---|---|---|---|---|---|",
    ]
    for source, target in PAIRS:
        pair = f"{source}_to_{target}"
        for r in results:
            s = r[pair]
            cells = [f"{s[k]['linprobe']:.2f} / {s[k]['knn']:.2f}"
                     for k in ("source_only", "scratch_full", "scratch_third", "continue_third")]  # fmt: skip
            gain = s["continue_third"]["linprobe"] - s["scratch_third"]["linprobe"]
            lines.append(f"| {NAMES[source]} -> {NAMES[target]} | {r['seed']} | {' | '.join(cells)} | {gain:+.2f} |")
    met = all(
        r[f"{s}_to_{t}"]["continue_third"]["linprobe"] >= r[f"{s}_to_{t}"]["scratch_third"]["linprobe"] + 3
        for r in results
        for s, t in PAIRS
    )
    lines += ["", f"Continued >= scratch + 3 probe points at the same budget everywhere: {'yes' if met else 'no'}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion_mnist", default="data/fashion_mnist", help="prepare_fashion_mnist.py's output")
    parser.add_argument("--mnist", default="data/mnist", help="the same for MNIST (--classes digits)")
    parser.add_argument("--out", default="runs/finetune_study", help="shared with scripts/finetune_study.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--select", action="store_true", help="measure the continue recipe's choices (fit/val)")
    args = parser.parse_args()
    if args.select:
        return select(args)
    results = [run_seed(args, seed) for seed in args.seeds]
    out = Path(args.out)
    (out / "continue.json").write_text(json.dumps({"cpu": cpu(), "results": results}, indent=1))
    (out / "continue.md").write_text(table(results, cpu()))
    print((out / "continue.md").read_text())


if __name__ == "__main__":
    main()
