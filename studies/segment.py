"""Does MAE pretraining help segmentation from the patch tokens? On the Fashion-MNIST scenes
(scripts/fashion_scenes.py: 2-4 garments on a textured background, 11 classes), for each seed: the probe (`--head
linear`, encoder frozen) and the fine-tune (`--head progressive`, encoder trained with layer decay) of recipes/segment/,
each from the MAE encoder (recipes/segment/pretrain.yaml on the train scenes' images, labels unused) and from a
random-init encoder of the same architecture (seeded); on every training scene's labels and on a tenth of them.

Test mIoU on the 1,000 test scenes, the last evaluation of each run (nothing selected on test; the recipes' settings
are their own). Writes OUT/results.json and OUT/results.md. A stage that finished is not run again. From the
repository root:

    python scripts/fashion_scenes.py --output data/fashion_scenes
    python -m studies.segment --scenes data/fashion_scenes --out runs/segment_study
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml

import mae
from studies import harness

RECIPES = harness.RECIPES / "segment"
LABELS = {"all": "train", "tenth": "train_10pct"}
TENTH_EPOCHS = 3  # a tenth of the scenes gets 3x the recipe's epochs (0.3x its steps), evaluated every 3rd
HEADS = {"probe": "probe.yaml", "finetune": "finetune.yaml"}
MARGINS = {  # the study's questions: name -> (run, the run it is compared with)
    "MAE probe over random-init probe": ("probe_mae", "probe_random"),
    "MAE fine-tune over MAE probe": ("finetune_mae", "probe_mae"),
    "MAE fine-tune over random-init fine-tune": ("finetune_mae", "finetune_random"),
}


def random_init(pretrain: Path, seed: int) -> Path:
    """The pretrained run's model (its record) with fresh seeded weights, exported beside the study."""
    path = pretrain.parent / f"random_init_seed{seed}" / "encoder.safetensors"
    if not path.exists():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            mae.export_encoder(mae.MaskedAutoencoder.from_spec(mae.read_spec(pretrain)), path)
    return path


def last_segment_eval(run: Path) -> dict:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if "miou" in m][-1]


def run_seed(args: argparse.Namespace, pretrain: Path, seed: int) -> dict:
    out = Path(args.out) / f"seed{seed}"
    scenes = Path(args.scenes)
    encoders = {"mae": str(pretrain), "random": str(random_init(pretrain, seed))}
    r: dict = {"seed": seed, "miou": {}, "pixel_acc": {}, "seconds": {}}
    for labels, folder in LABELS.items():
        for head, recipe in HEADS.items():
            for encoder, path in encoders.items():
                run = out / f"{head}_{encoder}_{labels}"
                overrides = {"seed": seed, "pretrained": path, "loop": {"progress": False},
                             "data": {"path": str(scenes / folder), "val_path": str(scenes / "test")}}  # fmt: skip
                if labels == "tenth":
                    epochs = yaml.safe_load((RECIPES / recipe).read_text())["loop"]["epochs"] * TENTH_EPOCHS
                    overrides["loop"] |= {"epochs": epochs, "eval_every": TENTH_EPOCHS}
                r["seconds"][run.name] = harness.stage("segment", run, RECIPES / recipe, **overrides)
                last = last_segment_eval(run)
                r["miou"][run.name], r["pixel_acc"][run.name] = last["miou"], last["pixel_acc"]
    return r


def table(results: list[dict], meta: dict) -> str:
    rows = [f"{head}_{enc}_{lab}" for lab in LABELS for head in HEADS for enc in ("mae", "random")]
    seeds = [r["seed"] for r in results]
    head = "| run (labels) | " + " | ".join(f"mIoU seed {s}" for s in seeds) + " | mean | minutes (mean) |"
    lines = [head, "|" + "---|" * (len(seeds) + 3)]
    for row in rows:
        vals = [r["miou"][row] for r in results]
        mins = np.mean([r["seconds"][row] for r in results]) / 60
        lines.append(f"| {row} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {np.mean(vals):.2f} | {mins:.1f} |")
    lines += ["", "| margin (mIoU points, per seed) | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|" + "---|" * (len(seeds) + 1)]  # fmt: skip
    for lab in LABELS:
        for name, (a, b) in MARGINS.items():
            diffs = [r["miou"][f"{a}_{lab}"] - r["miou"][f"{b}_{lab}"] for r in results]
            lines.append(f"| {name} ({lab} labels) | " + " | ".join(f"{d:+.2f}" for d in diffs) + " |")
    lines.append(f"\nPretraining: {meta['pretrain_minutes']:.1f} minutes. Machine: {meta['machine']}.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenes", required=True, help="the output folder of scripts/fashion_scenes.py")
    p.add_argument("--out", required=True)
    p.add_argument("--pretrained", help="a finished pretraining run to use instead of running the recipe")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--pretrain_epochs", type=int, help="override the pretraining recipe's epochs")
    args = p.parse_args()
    pretrain = Path(args.pretrained) if args.pretrained else Path(args.out) / "pretrain"
    seconds = 0.0
    if not args.pretrained:
        loop = {"progress": False} | ({"epochs": args.pretrain_epochs} if args.pretrain_epochs else {})
        data = {"path": str(Path(args.scenes) / "train" / "images")}
        seconds = harness.stage("pretrain", pretrain, RECIPES / "pretrain.yaml", data=data, loop=loop)
    elif harness.seconds_file(pretrain).exists():
        seconds = float(harness.seconds_file(pretrain).read_text())
    results = [run_seed(args, pretrain, s) for s in args.seeds]
    meta = {"machine": harness.machine(), "pretrain_minutes": seconds / 60, "args": vars(args)}
    harness.report(Path(args.out), "results", table(results, meta), {"meta": meta, "seeds": results})


if __name__ == "__main__":
    main()
