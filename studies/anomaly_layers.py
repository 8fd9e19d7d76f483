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
from studies.anomaly_rgb import masks_of, position_gaussian, read
from studies.anomaly_scores import auroc, gaussian_distance, random_init

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


def score(train: torch.Tensor, test: torch.Tensor, model, anomalous, masks) -> dict:
    """A Gaussian per patch position on [N, L, D] tokens: an image's score the mean distance over positions, its map
    the distances upsampled bilinearly (as `mae anomaly` scores)."""
    d = torch.stack([gaussian_distance(train[:, i], test[:, i], SHRINKAGE) for i in range(train.shape[1])], 1)
    grid = d.view(len(d), 1, *model.grid_size)
    maps = torch.nn.functional.interpolate(grid, size=tuple(model.img_size), mode="bilinear", align_corners=False)
    return {
        "image_auroc": auroc(d.mean(1).numpy(), anomalous),
        "pixel_auroc": auroc(maps.numpy().ravel(), masks.ravel()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a pretraining run on the category's normal images")
    p.add_argument("--category", type=Path, required=True, help="DATA/<category> with train/ and test/")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="the random-init twin's seed")
    args = p.parse_args(argv)
    stats = harness.run_config(args.run)["data"]
    results: dict[str, dict] = {}
    for name, source in (("MAE", args.run), ("random-init", random_init(args.run, args.seed))):
        model = mae.load_pretrained(source).eval()
        train, _ = read(args.category / "train", model, stats)
        test, files = read(args.category / "test", model, stats)
        anomalous = np.array([f.parent.name != "good" for f in files])
        masks = masks_of(files, tuple(model.img_size))
        a, b = layer_tokens(model, train), layer_tokens(model, test)
        names = ["patch embedding"] + [f"block {i}" for i in range(1, len(a) - 1)] + ["final norm (the default)"]
        for i, layer in enumerate(names):
            results[f"{name}: {layer}"] = score(a[i], b[i], model, anomalous, masks)
        both = score(torch.cat([a[0], a[-1]], -1), torch.cat([b[0], b[-1]], -1), model, anomalous, masks)
        results[f"{name}: patch embedding + final norm"] = both
        if name == "MAE":
            s, maps = position_gaussian(train, test, model)
            pixel = {"image_auroc": auroc(s, anomalous), "pixel_auroc": auroc(maps.ravel(), masks.ravel())}
            results["pixels: gaussian per patch position"] = pixel
    lines = ["| features | image AUROC | pixel AUROC |", "|---|---|---|"]
    lines += [f"| {k} | {v['image_auroc'] * 100:.1f} | {v['pixel_auroc'] * 100:.1f} |" for k, v in results.items()]
    data = {"machine": harness.machine(), "run": str(args.run), "category": str(args.category), "results": results}
    harness.report(args.output, "results", "\n".join(lines), data)


if __name__ == "__main__":
    main()
