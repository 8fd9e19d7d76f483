"""The Fashion-MNIST study's read-outs (`python -m studies.layers --out runs/fashion_mnist`): on fit/val, whether a
richer linear read-out (other blocks, the cls token, concatenations) would serve the MAE encoder better than the probe's
feature, and the random-init encoder alike. Writes OUT/layers.md and OUT/layers.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import mae
from studies import harness
from studies.fashion_mnist import data_stats, fit_logistic, pixels, random_encoder


def block_features(encoder: torch.nn.Module, images: torch.Tensor, mean: list, std: list) -> dict[str, torch.Tensor]:
    """What a linear probe could read from each block of a timm ViT: the probe's feature (final norm, average of the
    patch tokens), the final cls token, and the average patch token after every block (before the final norm).
    The gray images [N, 784] in [0, 1] are given as many channels as the encoder reads, normalised per channel."""
    out: dict[str, list[torch.Tensor]] = {}
    encoder.eval()
    channels, prefix = encoder.patch_embed.proj.in_channels, encoder.num_prefix_tokens
    m, s = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (mean, std))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in images.split(500):
            x = (batch.view(-1, 1, 28, 28).expand(-1, channels, -1, -1) - m) / s
            final, inter = encoder.forward_intermediates(
                x, indices=len(encoder.blocks), return_prefix_tokens=True, output_fmt="NLC"
            )
            feats = {"final": final[:, prefix:].mean(1), "cls": final[:, 0]}
            feats.update({f"block{i + 1}": tokens.mean(1) for i, (tokens, _) in enumerate(inter)})
            for k, v in feats.items():
                out.setdefault(k, []).append(v.float())
    return {k: torch.cat(v) for k, v in out.items()}


def readouts(depth: int) -> dict[str, list[str]]:
    return {
        "the probe's feature (final norm, average pooling)": ["final"],
        "final cls token": ["cls"],
        "average + cls token (concatenated)": ["final", "cls"],
        **{f"block {i} average (before the final norm)": [f"block{i}"] for i in range(1, depth + 1)},
        "last 4 blocks' averages (concatenated)": [f"block{i}" for i in range(depth - 3, depth + 1)],
        f"all {depth} blocks' averages (concatenated)": [f"block{i}" for i in range(1, depth + 1)],
    }


def layers(out: Path, data: Path, seed: int) -> None:
    """Which features a linear read-out finds best, MAE against random init: logistic regression fit -> val on
    the seed's encoders (run the study first). Richer read-outs lift the random encoder more than the MAE's."""
    pretrained = out / f"seed{seed}" / "pretrain"
    if not (pretrained / "encoder.safetensors").exists():
        sys.exit(f"{pretrained}/encoder.safetensors: not found; run the study for seed {seed} first")
    stats = data_stats(pretrained)  # the statistics the encoder was pretrained with
    (xfit, yfit), (xval, yval) = pixels(data, "fit"), pixels(data, "val")
    rand = random_encoder(out / f"seed{seed}" / "random_encoder.safetensors", seed, pretrained)  # the study's, rebuilt
    feats = {}
    for name, path in {"MAE": pretrained, "random init": rand}.items():
        encoder = mae.load_encoder(path)
        feats[name] = tuple(block_features(encoder, x, stats["mean"], stats["std"]) for x in (xfit, xval))
    rows = []
    for label, keys in readouts(len([k for k in feats["MAE"][0] if k.startswith("block")])).items():
        row = {"readout": label}
        for name, (fit, val) in feats.items():
            torch.manual_seed(seed)
            row[name] = round(fit_logistic(torch.cat([fit[k] for k in keys], 1), yfit,
                                           torch.cat([val[k] for k in keys], 1), yval), 2)  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    torch.manual_seed(seed)
    raw = fit_logistic(xfit, yfit, xval, yval)
    lines = [
        f"Linear read-outs of the seed-{seed} encoders (pretrained on train, labels unused): logistic regression "
        f"on fit (54,000), top-1 (%) on val (6,000); raw pixels: {raw:.2f}",
        "",
        "| read-out | MAE | random init | MAE - random |",
        "|---|---|---|---|",
        *[f"| {r['readout']} | {r['MAE']:.2f} | {r['random init']:.2f} | {r['MAE'] - r['random init']:+.2f} |"
          for r in rows],
    ]  # fmt: skip
    harness.report(out, "layers", "\n".join(lines), {"pixels": round(raw, 2), "rows": rows})


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fashion_mnist", help="the Fashion-MNIST study's output folder")
    parser.add_argument("--data", default="data/fashion_mnist", help="the prepared splits (fit, val, train, test)")
    parser.add_argument("--seed", type=int, default=0, help="whose encoders to read out")
    args = parser.parse_args(argv)
    layers(Path(args.out), Path(args.data), args.seed)


if __name__ == "__main__":
    main()
