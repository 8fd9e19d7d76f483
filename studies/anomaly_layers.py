"""Which encoder layer's tokens separate colour defects: a Gaussian per patch position (the default score of `mae
anomaly`) fitted on the tokens of each layer of a pretrained run's encoder (the patch embedding, each block, the final
norm) and of a random-init twin, against the same Gaussian on raw pixel patches. Image AUROC and pixel AUROC on a
category of the colour-defect set (scripts/defect_photos.py), nothing chosen on test: every layer is reported.

    python -m studies.anomaly_rgb --data data/defects_brick --output runs/anomaly_rgb_brick --seeds 0   # the run
    python -m studies.anomaly_layers --run runs/anomaly_rgb_brick/brick_seed0 --category data/defects_brick/brick \
        --output runs/anomaly_layers_brick

OUT/results.json holds every number, OUT/results.md the table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import mae
from studies import harness
from studies.anomaly_rgb import kinds_of, masks_of, position_gaussian, position_scores, read
from studies.anomaly_scores import auroc, random_init

SHRINKAGE = 1e-3  # mae anomaly's, for its per-position Gaussian


@torch.no_grad()
def layer_tokens(model: mae.MaskedAutoencoder, images: torch.Tensor, batch: int = 50) -> list[torch.Tensor]:
    """[N, L, D] patch tokens after the patch embedding (with positions), after each block, and after the final
    norm (what `mae anomaly` scores), prefix tokens left out."""
    enc, prefix = model.encoder, model.encoder.num_prefix_tokens
    out: list[list[torch.Tensor]] = []
    for start in range(0, len(images), batch):
        x = enc.norm_pre(enc._pos_embed(enc.patch_embed(images[start : start + batch])))
        layers = [x]
        for block in enc.blocks:
            x = block(x)
            layers.append(x)
        layers.append(enc.norm(x))
        out.append([t[:, prefix:].float() for t in layers])
    return [torch.cat([chunk[i] for chunk in out]) for i in range(len(out[0]))]


def aurocs(scores: np.ndarray, maps: np.ndarray, anomalous: np.ndarray, masks: np.ndarray) -> dict:
    return {"image_auroc": auroc(scores, anomalous), "pixel_auroc": auroc(maps.ravel(), masks.ravel())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a pretraining run on the category's normal images")
    p.add_argument("--category", type=Path, required=True, help="DATA/<category> with train/ and test/")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="the random-init twin's seed")
    args = p.parse_args(argv)
    stats = harness.run_config(args.run)["data"]
    model = mae.load_pretrained(args.run).eval()
    train, _ = read(args.category / "train", model, stats)
    test, files = read(args.category / "test", model, stats)  # the random-init twin has the run's record and size
    anomalous = kinds_of(files) != "good"
    masks = masks_of(files, tuple(model.img_size))
    pixels = aurocs(*position_gaussian(train, test, model), anomalous, masks)
    results: dict[str, dict] = {}
    for name, source in (("MAE", args.run), ("random-init", random_init(args.run, args.seed))):
        model = mae.load_pretrained(source).eval()
        a, b = layer_tokens(model, train), layer_tokens(model, test)
        names = ["patch embedding"] + [f"block {i}" for i in range(1, len(a) - 1)] + ["final norm (the default)"]
        pairs = [*zip(a, b, strict=True), (torch.cat([a[0], a[-1]], -1), torch.cat([b[0], b[-1]], -1))]
        for layer, (train_tokens, test_tokens) in zip([*names, "patch embedding + final norm"], pairs, strict=True):
            scored = position_scores(train_tokens, test_tokens, model, SHRINKAGE)
            results[f"{name}: {layer}"] = aurocs(*scored, anomalous, masks)
        if name == "MAE":  # the table's order: the pretrained encoder, the pixels, the random-init encoder
            results["pixels: gaussian per patch position"] = pixels
    lines = ["| features | image AUROC | pixel AUROC |", "|---|---|---|"]
    lines += [f"| {k} | {v['image_auroc'] * 100:.1f} | {v['pixel_auroc'] * 100:.1f} |" for k, v in results.items()]
    data = {"machine": harness.machine(), "run": str(args.run), "category": str(args.category), "results": results}
    harness.report(args.output, "results", "\n".join(lines), data)


if __name__ == "__main__":
    main()
