"""The Fashion-MNIST study: MAE pretraining on 2 CPU cores, then linear probe, k-NN and fine-tuning on the
10,000 test images, beside baselines under the same protocol and budget:

- logistic regression on raw pixels;
- the same encoder randomly initialised (linear probe, k-NN);
- the same ViT trained from scratch with the fine-tuning recipe.

Every stage is `mae.<stage>(...)` with a recipe from recipes/fashion_mnist/; nothing is selected on the test split
(fixed epochs, the last evaluation is reported). Writes OUT/results.json, OUT/results.md, OUT/reconstructions.png
and OUT/pretrain_loss.png. From the repository root:

    python scripts/prepare_fashion_mnist.py --output data/fashion_mnist
    python -m studies.fashion_mnist --out runs/fashion_mnist --seeds 0 1
    python -m studies.fashion_mnist --out runs/fashion_mnist_select --select   # how the recipe was chosen
    python -m studies.fashion_mnist --out runs/fashion_mnist_decoders --select --candidates decoders
    python -m studies.layers --out runs/fashion_mnist                          # after the study: read-outs

`--select` compares pretraining variants on a short budget without the test split: each pretrains on fit (54,000
train images) and is scored by the linear probe recipe on val (the 6,000 train images held out by
prepare_fashion_mnist.py). Writes OUT/selection.md and OUT/selection.json.

`studies.layers` asks, again on fit/val, whether a richer linear read-out (other blocks, the cls token, concatenations)
would serve the MAE encoder better than the probe's feature, and the random-init encoder alike (studies/layers.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import mae
from studies import harness

RECIPES = harness.RECIPES / "fashion_mnist"


def recipe_stage(name: str, run: Path, **overrides) -> float:
    """`mae.NAME` with recipes/fashion_mnist/NAME.yaml, once (`harness.stage`)."""
    return harness.stage(name, run, RECIPES / f"{name}.yaml", **overrides)


def fit_logistic(xtr: torch.Tensor, ytr: torch.Tensor, xte: torch.Tensor, yte: torch.Tensor, epochs: int = 30) -> float:
    """Multinomial logistic regression on standardised inputs (full-batch L-BFGS); test top-1 (%)."""
    mean, std = xtr.mean(0), xtr.std(0) + 1e-3
    xtr, xte = (xtr - mean) / std, (xte - mean) / std
    linear = torch.nn.Linear(xtr.shape[1], int(ytr.max()) + 1)
    opt = torch.optim.LBFGS(linear.parameters(), lr=1, max_iter=20, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(xtr), ytr) + 1e-4 * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    for _ in range(epochs):
        opt.step(closure)
    with torch.no_grad():
        return (linear(xte).argmax(1) == yte).float().mean().item() * 100


def pixels(data: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A prepared split as (flattened pixels in [0, 1] [N, 784], labels [N])."""
    images, labels = harness.load_split(data, split)
    return torch.from_numpy(images).flatten(1).float() / 255, torch.from_numpy(labels)


def logistic_regression(data: Path, seed: int) -> tuple[float, float]:
    """Logistic regression on raw pixels, train -> test; (test top-1, seconds)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    top1 = fit_logistic(*pixels(data, "train"), *pixels(data, "test"))
    return top1, time.perf_counter() - start


def data_stats(pretrain_run: Path) -> dict:
    """The data statistics a pretraining run measured (its config.yaml): the random encoder is given the same, so
    that both encoders see the same inputs."""
    data = harness.run_config(pretrain_run)["data"]
    return {"mean": data["mean"], "std": data["std"]}


def random_encoder(path: Path, seed: int, pretrain_run: Path) -> Path:
    """The pretraining run's model (its record: architecture and data statistics), randomly initialised (the official
    init), as an encoder export."""
    torch.manual_seed(seed)
    return mae.export_encoder(mae.MaskedAutoencoder.from_spec(mae.read_spec(pretrain_run)), path)


def loss_curve(run: Path, png: Path) -> None:
    """The pretraining loss per logged step, drawn with PIL (no plotting library needed)."""
    from PIL import Image, ImageDraw

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    pts = [(m["step"], m["loss"]) for m in rows if "eval" not in m and m.get("loss") is not None]
    w, h, pad = 640, 360, 48
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    lo, hi = min(ys), max(ys)
    hi = hi if hi > lo else lo + 1  # a flat or one-point curve still draws

    def xy(s, v):
        return pad + (s - xs[0]) / max(1, xs[-1] - xs[0]) * (w - 2 * pad), h - pad - (v - lo) / (hi - lo) * (
            h - 2 * pad
        )

    d.line([xy(s, v) for s, v in pts], fill=(200, 40, 40), width=2)
    d.rectangle([pad, pad, w - pad, h - pad], outline="black")
    target = "norm-pix" if harness.run_config(run)["model"]["norm_pix_loss"] else "pixel"
    d.text((pad, 10), f"MAE pretraining loss ({target} MSE on masked patches), {xs[-1]} steps", fill="black")
    d.text((5, pad - 6), f"{hi:.3f}", fill="black")
    d.text((5, h - pad - 6), f"{lo:.3f}", fill="black")
    d.text((w - pad - 40, h - pad + 8), f"step {xs[-1]}", fill="black")
    img.save(png)


def test_images(data: Path, folder: Path, n: int = 8) -> list[str]:
    import datasets

    ds = datasets.load_from_disk(str(data / "test"))
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"test_{i}.png"
        ds[i * 997 % len(ds)]["image"].save(p)  # spread over the 10,000 test images
        paths.append(str(p))
    return paths


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    out, data = Path(args.out) / f"seed{seed}", Path(args.data)
    common = {"seed": seed, "loop": {"progress": False}}
    probe_data = {"path": str(data / "train"), "val_path": str(data / "test")}
    r: dict = {"seed": seed, "seconds": {}}
    t = r["seconds"]
    t["pretrain"] = recipe_stage("pretrain", out / "pretrain", data={"path": str(data / "train")}, **common)
    rand = random_encoder(out / "random_encoder.safetensors", seed, out / "pretrain")
    full = seed == args.seeds[0] or args.full_every_seed
    for name, pretrained in (("mae", out / "pretrain"), ("random", rand)):
        for stage in ("linprobe", "knn", "finetune"):
            if (stage == "finetune" and name == "random" and args.skip_scratch) or (
                not full and (name == "random" or stage == "finetune")
            ):
                continue  # later seeds repeat the headline numbers (MAE probe and k-NN) unless asked
            key = f"{stage}_{name}"
            seeded = {"seed": seed} if stage == "knn" else common  # k-NN trains nothing: it shows no bar
            options = harness.merge(seeded, {"data": probe_data})
            if name == "random":  # an export of a fresh model records no data statistics: the MAE run's
                options = harness.merge(options, {"data": data_stats(out / "pretrain")})
            if stage == "finetune" and name == "random":  # from scratch every layer trains: frozen random weights
                options = harness.merge(options, {"model": {"frozen_blocks": 0}})  # would only handicap it
            t[key] = recipe_stage(stage, out / key, pretrained=str(pretrained), **options)
            r[key] = round(harness.last_eval(out / key)["top1"], 2)
    r["logreg_pixels"], t["logreg_pixels"] = logistic_regression(data, seed)
    r["logreg_pixels"] = round(r["logreg_pixels"], 2)
    if seed == args.seeds[0]:
        images = test_images(data, out / "test_images")
        figure = Path(args.out) / "reconstructions.png"
        mae.visualize(checkpoint=str(out / "pretrain"), images=images, output=str(figure))
        loss_curve(out / "pretrain", Path(args.out) / "pretrain_loss.png")
    harness.write_whole(out / "result.json", json.dumps(r, indent=2))
    return r


# Pretraining variants for --select: changes of recipes/fashion_mnist/pretrain.yaml.
CANDIDATES = {
    "recipe": {
        "batch 256, norm-pix targets (the paper's)": {"loop": {"batch_size": 256}, "model": {"norm_pix_loss": True}},
        "batch 128, norm-pix targets": {"loop": {"batch_size": 128}, "model": {"norm_pix_loss": True}},
        "batch 128, pixel targets": {"loop": {"batch_size": 128}, "model": {"norm_pix_loss": False}},
    },
    "decoders": {
        "mae decoder (the paper's)": {"model": {"decoder": "mae"}},
        "cross decoder, every masked patch (the recipe's)": {"model": {"decoder": "cross"}},
        "cross decoder, a quarter of the masked patches": {"model": {"decoder": "cross", "predict_ratio": 0.25}},
    },
    "channels": {
        "3 channels, fixed statistics (the earlier recipe's)": {
            "model": {"in_chans": 3},
            "data": {"mean": [0.286, 0.286, 0.286], "std": [0.353, 0.353, 0.353]},
        },
        "1 channel, statistics measured (the recipe's)": {},
    },
}
SELECT_EPOCHS, SELECT_WARMUP = 4, 0.67  # a third of a 12-epoch schedule with 2 epochs of warm-up


def select(args: argparse.Namespace) -> None:
    """Pretrain each candidate on fit for SELECT_EPOCHS, then linear-probe on fit and score on val."""
    out, data = Path(args.out), Path(args.data)
    common = {"seed": args.seeds[0], "loop": {"progress": False}}
    short = {"loop": {"epochs": SELECT_EPOCHS, "eval_every": 0}, "optim": {"warmup_epochs": SELECT_WARMUP}}
    rows = []
    for i, (name, change) in enumerate(CANDIDATES[args.candidates].items()):
        run = out / f"candidate{i}"
        fit = {"data": {"path": str(data / "fit")}}
        seconds = recipe_stage("pretrain", run / "pretrain", **harness.merge(common, fit, short, change))
        probe = {"data": {"path": str(data / "fit"), "val_path": str(data / "val")}}
        recipe_stage("linprobe", run / "linprobe", pretrained=str(run / "pretrain"), **harness.merge(common, probe))
        rows.append({"candidate": name, "change": change, "pretrain_minutes": round(seconds / 60, 1),
                     "val_top1": round(harness.last_eval(run / "linprobe")["top1"], 2)})  # fmt: skip
    lines = [
        f"Pretraining variants, {SELECT_EPOCHS} epochs on fit (54,000 images); linear probe top-1 (%) on val "
        f"(6,000 train images held out); seed {args.seeds[0]}",
        "",
        "| candidate | change | val top-1 | pretraining |",
        "|---|---|---|---|",
        *[f"| {r['candidate']} | `{json.dumps(r['change'])}` | {r['val_top1']:.2f} | {r['pretrain_minutes']} min |"
          for r in rows],
    ]  # fmt: skip
    harness.report(out, "selection", "\n".join(lines), rows)


ROWS = {
    "linprobe_mae": "MAE encoder, linear probe",
    "knn_mae": "MAE encoder, k-NN (k=20)",
    "finetune_mae": "MAE encoder, fine-tune",
    "linprobe_random": "random-init encoder, linear probe",
    "knn_random": "random-init encoder, k-NN (k=20)",
    "finetune_random": "same ViT from scratch, fine-tune",
    "logreg_pixels": "logistic regression, raw pixels",
}


def table(results: list[dict], machine: str, name: str) -> str:
    seeds = [r["seed"] for r in results]
    lines = [
        f"{name} test top-1 (%), 10,000 images; seeds {seeds}; {machine}",
        "",
        "| model | " + " | ".join(f"seed {s}" for s in seeds) + f" | wall-clock (seed {seeds[0]}) |",
        "|---|" + "---|" * len(seeds) + "---|",
    ]
    for key, label in ROWS.items():
        if key in results[0]:
            secs = results[0]["seconds"].get(key)
            clock = f" {secs / 60:.1f} min |" if secs else " |"
            cells = " | ".join(f"{r[key]:.2f}" if key in r else "-" for r in results)
            lines.append(f"| {label} | {cells} |{clock}")
    pretrain = results[0]["seconds"]["pretrain"] / 60
    lines.append("| (MAE pretraining, no labels) | " + " | ".join("" for _ in seeds) + f" | {pretrain:.1f} min |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/fashion_mnist", help="output of scripts/prepare_fashion_mnist.py")
    parser.add_argument("--out", default="runs/fashion_mnist")
    parser.add_argument("--name", default="Fashion-MNIST", help="the data's name in the table")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--skip_scratch", action="store_true", help="leave out the from-scratch fine-tune baseline")
    parser.add_argument(
        "--full_every_seed",
        action="store_true",
        help="every stage for every seed (default: seeds after the first repeat pretraining, "
        "the MAE linear probe and k-NN)",
    )
    parser.add_argument("--select", action="store_true", help="compare pretraining variants on fit/val (no test)")
    parser.add_argument(
        "--candidates", choices=sorted(CANDIDATES), default="recipe", help="which variants --select runs"
    )
    args = parser.parse_args(argv)
    if not (Path(args.data) / "fit").exists():  # a fresh clone: the user tool prepares the data (Debian's files)
        prepare = harness.RECIPES.parent / "scripts" / "prepare_fashion_mnist.py"
        if subprocess.run([sys.executable, str(prepare), "--output", args.data]).returncode != 0:
            parser.exit(2, f"--data {args.data}: no prepared splits, and {prepare.name} could not make them (above)\n")
    if args.select:
        return select(args)
    machine = harness.machine()
    results = [run_seed(args, seed) for seed in args.seeds]
    harness.report(
        Path(args.out), "results", table(results, machine, args.name), {"machine": machine, "results": results}
    )


if __name__ == "__main__":
    main()
