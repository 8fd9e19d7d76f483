"""The Fashion-MNIST study: MAE pretraining on 2 CPU cores, then linear probe, k-NN and fine-tuning on the
10,000 test images, beside baselines under the same protocol and budget:

- logistic regression on raw pixels;
- the same encoder randomly initialised (linear probe, k-NN);
- the same ViT trained from scratch with the fine-tuning recipe.

Every stage is the public `mae` command with a recipe from recipes/fashion_mnist/; nothing is selected on
the test split (fixed epochs, the last evaluation is reported). Writes OUT/results.json, OUT/results.md,
OUT/reconstructions.png and OUT/pretrain_loss.png.

    python scripts/fashion_mnist_study.py --out runs/fashion_mnist --seeds 0 1
    python scripts/fashion_mnist_study.py --out runs/fashion_mnist_select --select   # how the recipe was chosen
    python scripts/fashion_mnist_study.py --out runs/fashion_mnist_decoders --select --candidates decoders
    python scripts/fashion_mnist_study.py --out runs/fashion_mnist --layers          # after the study: read-outs

`--select` compares pretraining variants on a short budget without the test split: each pretrains
on fit (54,000 train images) and is scored by the linear probe recipe on val (the 6,000 train
images held out by prepare_fashion_mnist.py). Writes OUT/selection.md and OUT/selection.json.

`--layers` asks, again on fit/val, whether a richer linear read-out (other blocks, the cls token,
concatenations) would serve the MAE encoder better than the probe's feature, and the random-init
encoder alike. Writes OUT/layers.md and OUT/layers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

import mae

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist"


def seconds_file(log: Path) -> Path:
    """Where `sh` keeps a finished stage's wall-clock seconds: its presence means the stage is done."""
    return log.with_suffix(".seconds")


def sh(cmd: list[str], log: Path) -> float:
    """Run a command, its output to `log`; returns the wall-clock seconds; stops the study on failure.
    A stage that already finished (its `.seconds` file beside the log) is not run again."""
    done = seconds_file(log)
    if done.exists():
        return float(done.read_text())
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        sys.exit(f"study: `{' '.join(cmd)}` failed (exit {proc.returncode}); see {log}")
    seconds = time.perf_counter() - start
    done.write_text(str(seconds))
    return seconds


MAE = [sys.executable, "-m", "mae"]


def mae_stage(stage: str, log: Path, *options: str) -> float:
    """`mae STAGE --config recipes/fashion_mnist/STAGE.yaml OPTIONS`, run through `sh`."""
    return sh([*MAE, stage, "--config", str(RECIPES / f"{stage}.yaml"), *options], log)


def last_eval(out: Path) -> dict:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "top1" in m][-1]


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


def load_split(data: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A prepared split as (uint8 images [N, 28, 28], labels [N])."""
    import datasets
    import numpy as np

    ds = datasets.load_from_disk(str(data / split)).with_format("numpy")
    return torch.from_numpy(np.stack(list(ds["image"]))), torch.from_numpy(np.asarray(ds["label"], dtype="int64"))


def logistic_regression(data: Path, seed: int) -> tuple[float, float]:
    """Logistic regression on raw pixels, train -> test; (test top-1, seconds)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_split(data, "train"), load_split(data, "test")
    top1 = fit_logistic(xtr.flatten(1).float() / 255, ytr, xte.flatten(1).float() / 255, yte)
    return top1, time.perf_counter() - start


def random_encoder(path: Path, seed: int) -> Path:
    """The pretraining recipe's architecture, randomly initialised (the official init), as an export that
    carries the data statistics of the seed's pretraining run (so both encoders see the same inputs)."""
    model_cfg = yaml.safe_load((RECIPES / "pretrain.yaml").read_text())["model"]
    torch.manual_seed(seed)
    name = model_cfg.pop("name")
    run = yaml.safe_load((path.parent / "pretrain" / "config.yaml").read_text())
    stats = {"data": {"mean": run["data"]["mean"], "std": run["data"]["std"]}}
    return mae.weights.export.save_encoder(mae.create_mae(name, **model_cfg), path, stats)


def loss_curve(metrics: Path, png: Path) -> None:
    """The pretraining loss per logged step, drawn with PIL (no plotting library needed)."""
    from PIL import Image, ImageDraw

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    pts = [(m["step"], m["loss"]) for m in rows if "eval" not in m and m.get("loss") is not None]
    w, h, pad = 640, 360, 48
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    lo, hi = min(ys), max(ys)

    def xy(s, v):
        return pad + (s - xs[0]) / max(1, xs[-1] - xs[0]) * (w - 2 * pad), h - pad - (v - lo) / (hi - lo) * (
            h - 2 * pad
        )

    d.line([xy(s, v) for s, v in pts], fill=(200, 40, 40), width=2)
    d.rectangle([pad, pad, w - pad, h - pad], outline="black")
    cfg = yaml.safe_load((metrics.parent / "config.yaml").read_text())
    target = "norm-pix" if cfg["model"]["norm_pix_loss"] else "pixel"
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
        ds[i * 997]["image"].save(p)
        paths.append(str(p))
    return paths


def run_seed(args: argparse.Namespace, seed: int) -> dict:
    out, data = Path(args.out) / f"seed{seed}", Path(args.data)
    seeded = ["--seed", str(seed)]
    common = [*seeded, "--loop.progress", "false"]  # the training stages' bar off (k-NN trains nothing, shows none)
    probe_data = ["--data.path", str(data / "train"), "--data.val_path", str(data / "test")]
    r: dict = {"seed": seed, "seconds": {}}
    t = r["seconds"]
    t["pretrain"] = mae_stage(
        "pretrain", out / "pretrain.log", "--data.path", str(data / "train"), "--output_dir", str(out / "pretrain"),
        *common,
    )  # fmt: skip
    rand = random_encoder(out / "random_encoder.safetensors", seed)
    full = seed == args.seeds[0] or args.full_every_seed
    for name, pretrained in (("mae", out / "pretrain"), ("random", rand)):
        for stage in ("linprobe", "knn", "finetune"):
            if (stage == "finetune" and name == "random" and args.skip_scratch) or (
                not full and (name == "random" or stage == "finetune")
            ):
                continue  # later seeds repeat the headline numbers (MAE probe and k-NN) unless asked
            key = f"{stage}_{name}"
            # From scratch every layer trains: random weights kept frozen would only handicap the baseline.
            scratch = ["--model.frozen_blocks", "0"] if (stage, name) == ("finetune", "random") else []
            t[key] = mae_stage(
                stage, out / f"{key}.log", "--pretrained", str(pretrained), *probe_data,
                "--output_dir", str(out / key), *(seeded if stage == "knn" else common), *scratch,
            )  # fmt: skip
            r[key] = round(last_eval(out / key)["top1"], 2)
    r["logreg_pixels"], t["logreg_pixels"] = logistic_regression(data, seed)
    r["logreg_pixels"] = round(r["logreg_pixels"], 2)
    if seed == args.seeds[0]:
        sh(
            [
                *MAE,
                "visualize",
                "--checkpoint",
                str(out / "pretrain"),
                "--images",
                *test_images(data, out / "test_images"),
                "--output",
                str(Path(args.out) / "reconstructions.png"),
            ],
            out / "visualize.log",
        )
        loss_curve(out / "pretrain" / "metrics.jsonl", Path(args.out) / "pretrain_loss.png")
    (out / "result.json").write_text(json.dumps(r, indent=2))
    return r


# Pretraining variants for --select: extra options on top of recipes/fashion_mnist/pretrain.yaml.
CANDIDATES = {
    "recipe": {
        "batch 256, norm-pix targets (the paper's)": ["--loop.batch_size", "256", "--model.norm_pix_loss", "true"],
        "batch 128, norm-pix targets": ["--loop.batch_size", "128", "--model.norm_pix_loss", "true"],
        "batch 128, pixel targets": ["--loop.batch_size", "128", "--model.norm_pix_loss", "false"],
    },
    "decoders": {
        "mae decoder (the paper's)": ["--model.decoder", "mae"],
        "cross decoder, every masked patch (the recipe's)": ["--model.decoder", "cross"],
        "cross decoder, a quarter of the masked patches": ["--model.decoder", "cross", "--model.predict_ratio", "0.25"],
    },
    "channels": {
        "3 channels, fixed statistics (the earlier recipe's)": [
            "--model.in_chans",
            "3",
            "--data.mean",
            "[0.286, 0.286, 0.286]",
            "--data.std",
            "[0.353, 0.353, 0.353]",
        ],
        "1 channel, statistics measured (the recipe's)": [],
    },
}
SELECT_EPOCHS, SELECT_WARMUP = 4, 0.67  # a third of a 12-epoch schedule with 2 epochs of warm-up


def select(args: argparse.Namespace) -> None:
    """Pretrain each candidate on fit for SELECT_EPOCHS, then linear-probe on fit and score on val."""
    out, data = Path(args.out), Path(args.data)
    common = ["--seed", str(args.seeds[0]), "--loop.progress", "false"]
    rows = []
    for i, (name, extra) in enumerate(CANDIDATES[args.candidates].items()):
        run = out / f"candidate{i}"
        seconds = mae_stage(
            "pretrain", run / "pretrain.log", "--data.path", str(data / "fit"), "--output_dir", str(run / "pretrain"),
            "--loop.epochs", str(SELECT_EPOCHS), "--optim.warmup_epochs", str(SELECT_WARMUP),
            "--loop.eval_every", "0", *common, *extra,
        )  # fmt: skip
        mae_stage(
            "linprobe", run / "linprobe.log", "--pretrained", str(run / "pretrain"), "--data.path", str(data / "fit"),
            "--data.val_path", str(data / "val"), "--output_dir", str(run / "linprobe"), *common,
        )  # fmt: skip
        rows.append({"candidate": name, "options": extra, "val_top1": round(last_eval(run / "linprobe")["top1"], 2),
                     "pretrain_minutes": round(seconds / 60, 1)})  # fmt: skip
    lines = [
        f"Pretraining variants, {SELECT_EPOCHS} epochs on fit (54,000 images); linear probe top-1 (%) on val "
        f"(6,000 train images held out); seed {args.seeds[0]}",
        "",
        "| candidate | options | val top-1 | pretraining |",
        "|---|---|---|---|",
        *[f"| {r['candidate']} | `{' '.join(r['options'])}` | {r['val_top1']:.2f} | {r['pretrain_minutes']} min |"
          for r in rows],
    ]  # fmt: skip
    (out / "selection.json").write_text(json.dumps(rows, indent=2))
    (out / "selection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def block_features(encoder: torch.nn.Module, images: torch.Tensor, mean: list, std: list) -> dict[str, torch.Tensor]:
    """What a linear probe could read from each block: the probe's feature (final norm, average of the patch
    tokens), the final cls token, and the average patch token after every block (before the final norm).
    The gray images are given as many channels as the encoder reads, normalised per channel."""
    out: dict[str, list[torch.Tensor]] = {}
    encoder.eval()
    adapter = mae.models.encoder_adapter(encoder)
    channels = adapter.in_chans
    m, s = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (mean, std))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in images.split(500):
            x = (batch.float().div(255).unsqueeze(1).expand(-1, channels, -1, -1) - m) / s
            final, inter = encoder.forward_intermediates(
                x, indices=len(encoder.blocks), return_prefix_tokens=True, output_fmt="NLC"
            )
            feats = {"final": final[:, adapter.num_prefix_tokens :].mean(1), "cls": final[:, 0]}
            feats.update({f"block{i + 1}": tokens.mean(1) for i, (tokens, _) in enumerate(inter)})
            for k, v in feats.items():
                out.setdefault(k, []).append(v.float())
    return {k: torch.cat(v) for k, v in out.items()}


def layers(args: argparse.Namespace) -> None:
    """Which features a linear read-out finds best, MAE against random init: logistic regression fit -> val on
    the seed's encoders (run the study first). Richer read-outs lift the random encoder more than the MAE's."""
    out, data, seed = Path(args.out), Path(args.data), args.seeds[0]
    pretrained = out / f"seed{seed}" / "pretrain"
    if not (pretrained / "encoder.safetensors").exists():
        sys.exit(f"{pretrained}/encoder.safetensors: not found; run the study for seed {seed} first")
    spec = mae.weights.importers.read_encoder(str(pretrained))  # the statistics the encoder was pretrained with
    mean, std = list(spec.mean), list(spec.std)
    (xfit, yfit), (xval, yval) = load_split(data, "fit"), load_split(data, "val")
    rand = random_encoder(out / f"seed{seed}" / "random_encoder.safetensors", seed)  # the study's, rebuilt
    encoders = {"MAE": pretrained, "random init": rand}
    feats = {}
    for name, path in encoders.items():
        encoder = mae.load_encoder(path)
        feats[name] = (block_features(encoder, xfit, mean, std), block_features(encoder, xval, mean, std))
    depth = len([k for k in feats["MAE"][0] if k.startswith("block")])
    readouts = {
        "the probe's feature (final norm, average pooling)": ["final"],
        "final cls token": ["cls"],
        "average + cls token (concatenated)": ["final", "cls"],
        **{f"block {i} average (before the final norm)": [f"block{i}"] for i in range(1, depth + 1)},
        "last 4 blocks' averages (concatenated)": [f"block{i}" for i in range(depth - 3, depth + 1)],
        f"all {depth} blocks' averages (concatenated)": [f"block{i}" for i in range(1, depth + 1)],
    }
    rows = []
    for label, keys in readouts.items():
        row = {"readout": label}
        for name, (fit, val) in feats.items():
            torch.manual_seed(seed)
            row[name] = round(fit_logistic(torch.cat([fit[k] for k in keys], 1), yfit,
                                           torch.cat([val[k] for k in keys], 1), yval), 2)  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    torch.manual_seed(seed)
    pixels = fit_logistic(xfit.flatten(1).float() / 255, yfit, xval.flatten(1).float() / 255, yval)
    lines = [
        f"Linear read-outs of the seed-{seed} encoders (pretrained on train, labels unused): logistic regression "
        f"on fit (54,000), top-1 (%) on val (6,000); raw pixels: {pixels:.2f}",
        "",
        "| read-out | MAE | random init | MAE - random |",
        "|---|---|---|---|",
        *[f"| {r['readout']} | {r['MAE']:.2f} | {r['random init']:.2f} | {r['MAE'] - r['random init']:+.2f} |"
          for r in rows],
    ]  # fmt: skip
    (out / "layers.json").write_text(json.dumps({"pixels": round(pixels, 2), "rows": rows}, indent=2))
    (out / "layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def table(results: list[dict], machine: str, name: str) -> str:
    rows = [
        ("MAE encoder, linear probe", "linprobe_mae"),
        ("MAE encoder, k-NN (k=20)", "knn_mae"),
        ("MAE encoder, fine-tune", "finetune_mae"),
        ("random-init encoder, linear probe", "linprobe_random"),
        ("random-init encoder, k-NN (k=20)", "knn_random"),
        ("same ViT from scratch, fine-tune", "finetune_random"),
        ("logistic regression, raw pixels", "logreg_pixels"),
    ]
    seeds = [r["seed"] for r in results]
    lines = [
        f"{name} test top-1 (%), 10,000 images; seeds {seeds}; {machine}",
        "",
        "| model | " + " | ".join(f"seed {s}" for s in seeds) + f" | wall-clock (seed {seeds[0]}) |",
        "|---|" + "---|" * len(seeds) + "---|",
    ]
    for label, key in rows:
        if key in results[0]:
            secs = results[0]["seconds"].get(key)
            clock = f" {secs / 60:.1f} min |" if secs else " |"
            lines.append(
                f"| {label} | " + " | ".join(f"{r[key]:.2f}" if key in r else "-" for r in results) + " |" + clock
            )
    pretrain = results[0]["seconds"]["pretrain"] / 60
    lines.append("| (MAE pretraining, no labels) | " + " | ".join("" for _ in seeds) + f" | {pretrain:.1f} min |")
    return "\n".join(lines) + "\n"


def main() -> None:
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
    parser.add_argument("--layers", action="store_true", help="linear read-outs of each block on fit/val (no test)")
    args = parser.parse_args()
    if not (Path(args.data) / "fit").exists():
        sh(
            [sys.executable, str(Path(__file__).parent / "prepare_fashion_mnist.py"), "--output", args.data],
            Path(args.out) / "prepare.log",
        )
    if args.select:
        return select(args)
    if args.layers:
        return layers(args)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    results = [run_seed(args, seed) for seed in args.seeds]
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    (out / "results.md").write_text(table(results, machine, args.name))
    print(table(results, machine, args.name))


if __name__ == "__main__":
    main()
