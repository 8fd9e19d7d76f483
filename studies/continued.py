"""Does starting from another domain's MAE beat pretraining from scratch? Continued pretraining (`mae.pretrain(...,
init=...)`) measured on pairs of 28-px grayscale sets: Fashion-MNIST -> MNIST and MNIST -> Fashion-MNIST.

For each seed and pair SOURCE -> TARGET, every encoder pretrained with recipes/fashion_mnist/pretrain.yaml (its
architecture, 14 epochs at full budget), labels unused:

- `source_only`: SOURCE's full-budget encoder as it is, no pretraining on TARGET (what `init` starts from);
- `scratch_full`: from scratch on TARGET's 60,000 training images at the recipe's full budget (the run
  `pretrain_TARGET` of studies/finetune.py: point --out at its folder and it is reused);
- `scratch_BUDGET`: from scratch on TARGET at a smaller budget: one epoch (a fourteenth, warm-up 0.15 epoch)
  and a third (5 epochs, warm-up 1);
- `continue_BUDGET`: from SOURCE's encoder and decoder (`init`) with recipes/pretrain/continue.yaml over the
  from-scratch recipe, the same number of epochs.

Each is scored on TARGET's 10,000 test images by the linear probe and k-NN of recipes/fashion_mnist/ (trained on
TARGET's training images): OUT/continue.json and OUT/continue.md. A stage that finished is not run again.

`--select` measures the continue recipe's choices instead (learning rate, warm-up, mask ratio at one epoch),
from the seed-0 Fashion-MNIST encoder onto MNIST's `fit` split, probe and k-NN top-1 on `val`: no test image.
From the repository root:

    python -m studies.finetune --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft  # or not
    python -m studies.continued --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft --select
    python -m studies.continued --fashion_mnist data/fashion_mnist --mnist data/mnist --out runs/ft
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from studies import harness
from studies.fashion_mnist import recipe_stage

CONTINUE = harness.RECIPES / "pretrain" / "continue.yaml"
# the smaller budgets, each against scratch at the same epochs: {name: (epochs, scratch's warm-up epochs, label)}
BUDGETS = {"1ep": (1, 0.15, "1 epoch"), "third": (5, 1, "a third")}  # a 14th and a third of 14 epochs
PAIRS = (("fashion_mnist", "mnist"), ("mnist", "fashion_mnist"))
NAMES = {"fashion_mnist": "Fashion-MNIST", "mnist": "MNIST"}
# --select: the continue recipe's candidates at one epoch, against the from-scratch recipe's lr (blr 1.5e-3)
CANDIDATES = {  # the lr first; warm-up, mask ratio and a higher lr then at the best of the three (1.5e-3)
    "blr1.5e-3_wu0.15": {"optim": {"blr": 1.5e-3, "warmup_epochs": 0.15}},
    "blr5e-4_wu0.15": {"optim": {"blr": 5e-4, "warmup_epochs": 0.15}},
    "blr1.5e-4_wu0.15": {"optim": {"blr": 1.5e-4, "warmup_epochs": 0.15}},
    "blr1.5e-3_wu0": {"optim": {"blr": 1.5e-3, "warmup_epochs": 0}},
    "blr1.5e-3_wu0.15_mask0.6": {"optim": {"blr": 1.5e-3, "warmup_epochs": 0.15}, "model": {"mask_ratio": 0.6}},
    "blr3e-3_wu0.15": {"optim": {"blr": 3e-3, "warmup_epochs": 0.15}},
}


def pretrain(run: Path, data: Path, seed: int, change: dict | None = None) -> float:
    """recipes/fashion_mnist/pretrain.yaml with `change` (recipe sections) on `data` into `run`, once."""
    options = harness.merge({"data": {"path": str(data)}, "loop": {"progress": False}}, change or {})
    return recipe_stage("pretrain", run, seed=seed, **options)


def scores(encoder: Path, train: Path, test: Path, out: Path, seed: int) -> dict:
    """Linear probe and k-NN top-1 (%) of `encoder` on (train, test), the last evaluation of each; runs in `out`."""
    r = {}
    for name in ("linprobe", "knn"):
        run = out / f"{encoder.name}_{name}"
        quiet = {} if name == "knn" else {"loop": {"progress": False}}  # k-NN trains nothing: it shows no bar
        recipe_stage(name, run, pretrained=str(encoder), seed=seed,
                     data={"path": str(train), "val_path": str(test)}, **quiet)  # fmt: skip
        r[name] = round(harness.last_eval(run)["top1"], 2)
    return r


def scratch(budget: str) -> dict:
    epochs, warmup, _ = BUDGETS[budget]
    return {"loop": {"epochs": epochs}, "optim": {"warmup_epochs": warmup}}


def continued(budget: str, source: Path) -> dict:
    """recipes/pretrain/continue.yaml over the from-scratch recipe, at the budget's epochs, from `source`."""
    recipe = yaml.safe_load(CONTINUE.read_text())
    return harness.merge(recipe, {"loop": {"epochs": BUDGETS[budget][0]}, "init": str(source)})


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    out = Path(args.out) / f"seed{seed}"
    data = {"fashion_mnist": Path(args.fashion_mnist), "mnist": Path(args.mnist)}
    r: dict = {"seed": seed, "seconds": {}}
    for name, root in data.items():  # the full-budget encoders: the targets' scratch_full and the sources
        r["seconds"][f"pretrain_{name}"] = pretrain(out / f"pretrain_{name}", root / "train", seed)
    for source, target in PAIRS:
        pair = f"{source}_to_{target}"
        train, test = data[target] / "train", data[target] / "test"
        source_only = out / f"pretrain_{source}"
        runs = {"source_only": source_only, "scratch_full": out / f"pretrain_{target}"}
        for budget in BUDGETS:  # each budget scored before the next is pretrained: a stopped study has rows
            kinds = {"scratch": (out / f"pretrain_{target}_{budget}", scratch(budget)),
                     "continue": (out / f"continue_{pair}_{budget}", continued(budget, source_only))}  # fmt: skip
            if budget not in args.budgets and not all(harness.finished(run) for run, _ in kinds.values()):
                continue  # a budget not asked for is still reported once its pretraining is there
            for kind, (run, change) in kinds.items():
                runs[f"{kind}_{budget}"] = run
                r["seconds"][run.name] = pretrain(run, train, seed, change)
            r[pair] = {k: scores(run, train, test, out / f"eval_{target}", seed) for k, run in runs.items()}
    return r


def select(args: argparse.Namespace) -> None:
    """The continue recipe's choices on MNIST fit -> val at one epoch, from the seed-0 Fashion-MNIST encoder."""
    out = Path(args.out) / "select_continue"
    mn = Path(args.mnist)
    source = Path(args.out) / "seed0" / "pretrain_fashion_mnist"
    pretrain(source, Path(args.fashion_mnist) / "train", 0)
    one_epoch = {"loop": {"epochs": BUDGETS["1ep"][0], "min_steps": 0}, "init": str(source)}  # scratch's steps
    rows = {"source_only": scores(source, mn / "fit", mn / "val", out / "eval", 0)}  # what every run starts from
    runs = {"scratch_1ep": scratch("1ep")}  # what every candidate has to beat
    runs |= {name: harness.merge(one_epoch, change) for name, change in CANDIDATES.items()}
    for name, change in runs.items():
        seconds = pretrain(out / name, mn / "fit", 0, change)
        rows[name] = {**scores(out / name, mn / "fit", mn / "val", out / "eval", 0), "minutes": round(seconds / 60, 1)}
        print(name, rows[name], flush=True)
    cpu = harness.cpu()
    lines = [
        f"MNIST fit -> val top-1 (%) after one epoch (421 steps), from the seed-0 Fashion-MNIST encoder or from "
        f"scratch; {cpu}.",
        "",
        "| run | linear probe | k-NN | minutes |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {v['linprobe']:.2f} | {v['knn']:.2f} | {v.get('minutes', '-')} |" for k, v in rows.items()]
    harness.report(out, "select", "\n".join(lines), {"cpu": cpu, "rows": rows})


def table(results: list[dict], machine: str) -> str:
    budgets = [b for b in BUDGETS if any(f"continue_{b}" in r[f"{s}_to_{t}"] for r in results for s, t in PAIRS)]
    titles = {"source_only": "source only", "scratch_full": "scratch, full"}
    kinds = {"scratch": "scratch", "continue": "continued"}
    titles |= {f"{kind}_{b}": f"{word}, {BUDGETS[b][2]}" for b in budgets for kind, word in kinds.items()}
    columns = list(titles)
    gains = [f"continued - scratch ({BUDGETS[b][2]}), probe" for b in budgets]
    lines = [
        f"Test top-1 (%) on the target's 10,000 test images, linear probe / k-NN (k=20); {machine}.",
        "Full budget: recipes/fashion_mnist/pretrain.yaml (14 epochs); 1 epoch is a fourteenth, 5 epochs a third.",
        "",
        "| source -> target | seed | " + " | ".join(titles[c] for c in columns) + " | " + " | ".join(gains) + " |",
        "|---" * (2 + len(columns) + len(gains)) + "|",
    ]
    for source, target in PAIRS:
        for r in results:
            s = r[f"{source}_to_{target}"]
            cells = [f"{s[k]['linprobe']:.2f} / {s[k]['knn']:.2f}" if k in s else "-" for k in columns]
            cells += [f"{s[f'continue_{b}']['linprobe'] - s[f'scratch_{b}']['linprobe']:+.2f}"
                      if f"continue_{b}" in s else "-" for b in budgets]  # fmt: skip
            lines.append(f"| {NAMES[source]} -> {NAMES[target]} | {r['seed']} | {' | '.join(cells)} |")
    for b in budgets:
        rows = [r[f"{s}_to_{t}"] for r in results for s, t in PAIRS if f"continue_{b}" in r[f"{s}_to_{t}"]]
        met = all(x[f"continue_{b}"]["linprobe"] >= x[f"scratch_{b}"]["linprobe"] + 3 for x in rows)
        lines.append(f"\nContinued >= scratch + 3 probe points at {BUDGETS[b][2]}, in all {len(rows)} rows measured: "
                     f"{'yes' if met else 'no'}.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion_mnist", default="data/fashion_mnist", help="prepare_fashion_mnist.py's output")
    parser.add_argument("--mnist", default="data/mnist", help="the same for MNIST (--classes digits)")
    parser.add_argument("--out", default="runs/finetune_study", help="shared with studies/finetune.py")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--budgets", nargs="+", choices=list(BUDGETS), default=list(BUDGETS),
                        help="the budgets to pretrain; another is reported when its runs are finished")  # fmt: skip
    parser.add_argument("--select", action="store_true", help="measure the continue recipe's choices (fit/val)")
    args = parser.parse_args(argv)
    if args.select:
        return select(args)
    results = [run_seed(args, seed) for seed in args.seeds]
    cpu = harness.cpu()
    harness.report(Path(args.out), "continue", table(results, cpu), {"cpu": cpu, "results": results})


if __name__ == "__main__":
    main()
