"""Levers toward the anomaly study's goal (docs/anomaly.md), measured on its val split only: what a change of the
scoring or of the pretraining recipe does to the MAE's Gaussian feature distance, and, the same change applied, to
the random-init model's (the best baseline). Test images are never read.

Scoring levers, on the run folders of `scripts/anomaly_study.py` (same --output and seed; pretrained there):
the Gaussian's shrinkage below the study's grid; the features of each encoder block and of the last blocks
concatenated; a Gaussian per patch position (PaDiM's model) on the last block's tokens, and, for comparison, on
the raw pixels of each patch; the CLS token; horizontally flipped images; the Gaussian fused with the k-NN distance
or (the MAE only: a random decoder's maps are noise) with the reconstruction score, each standardised by its spread
over the fit images. Recipe levers (`--variant NAME=JSON`, overrides of the recipe as `mae.pretrain` takes them):
an MAE pretrained with the change on the same images and seed, scored with the study's Gaussian and with its
Gaussian per patch position, beside the study's and beside a random-init model of the variant's architecture (its
own baseline, where the change is architectural).

    python scripts/anomaly_study.py --output runs/anomaly_study --seeds 1               # the runs, if not there
    python scripts/anomaly_levers.py --output runs/anomaly_study --seed 1                # scoring levers
    python scripts/anomaly_levers.py --output runs/anomaly_study --seed 1 --classes 6 5 2 0 --scoring false \\
        --variant normpix='{"model": {"norm_pix_loss": true}}' --variant mask50='{"model": {"mask_ratio": 0.5}}'

Writes OUTPUT/levers_seed{S}.json: {lever: {"mae": [val AUROC per class], "random-init": [...]}}, and prints each
lever's means and its margin: the MAE's minus the random-init model's, the same lever on both; for a recipe lever,
also the variant's MAE minus the study recipe's. A later call with the same classes and seed adds its levers to the
file's (and prints them all); one with other classes or another seed is refused while the file is there.

Public API only: `mae.pretrain`, `mae.anomaly_maps`, and the timm encoder's blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from anomaly_study import (  # noqa: E402
    DEBIAN,
    SHRINKAGES,
    as_input,
    in_batches,
    load_split,
    pretrain_class,
    random_like,
    recipe_change,
    split,
    write_class_folder,
    write_whole,
)

import mae  # noqa: E402
from mae.anomaly_maps import (  # noqa: E402
    aggregate,
    anomaly_maps,
    auroc,
    gaussian_distance,
    knn_distance,
    load_with_decoder,
    masked_view_features,
    patch_tokens,
    position_distance,
)
from mae.run_folder import run_config  # noqa: E402

STUDY = 1e-3  # the study's chosen shrinkage: every lever but the shrinkage's own is scored at it
FINER = (1e-6, 1e-5, 1e-4)  # the shrinkage below the study's grid
FUSE_KNN = (0.25, 0.5, 1.0)
FUSE_RECON = (0.1, 0.25, 0.5, 1.0)
K = 5
BATCH = 500
MASK_SETS = (2, 4)  # complementary sets: the encoder sees half, or a quarter (pretraining's 75% mask)
VARIANT_MASKS = {0: "", 2: ", masked views (2 sets)", 4: ", masked views"}  # a recipe lever's Gaussian: whole images,
# half the patches visible at a time (a 50% mask's view) or a quarter (the study's)


@torch.no_grad()
def block_features(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([L, N, D] each block's patch tokens, final norm applied, averaged; [N, D] the last block's CLS token;
    [N, P, D] the last block's patch tokens, normed, one per patch position)."""
    model.eval()
    enc = model.encoder
    means, cls, patches = [], [], []
    for i in range(0, len(x), BATCH):
        tokens = enc.norm_pre(enc._pos_embed(enc.patch_embed(x[i : i + BATCH])))
        per = []
        for block in enc.blocks:
            tokens = block(tokens)
            normed = enc.norm(tokens)
            per.append(normed[:, enc.num_prefix_tokens :].mean(1))
        means.append(torch.stack(per))
        cls.append(normed[:, 0])
        patches.append(normed[:, enc.num_prefix_tokens :])
    return torch.cat(means, 1).double(), torch.cat(cls).double(), torch.cat(patches).double()


def masked_features(model, x: torch.Tensor, masks: int, seed: int) -> torch.Tensor:
    """[K, N, D]: the patch-token mean of the encoder under each of K complementary mask sets (the visible patches
    only, as in pretraining; `anomaly_maps`'s sets)."""
    model.eval()
    return in_batches(lambda b: masked_view_features(model, b, masks, seed), x, BATCH, dim=1).double()


def masked_levers(model, fit_x: torch.Tensor, val_x: torch.Tensor, seed: int) -> dict:
    """The Gaussian on features of masked images, as the encoder saw them in pretraining: K sets' features averaged,
    or each set's distance (to a Gaussian fitted on every set's features) averaged."""
    out = {}
    for masks in MASK_SETS:
        fit, val = masked_features(model, fit_x, masks, seed), masked_features(model, val_x, masks, seed)
        out[f"{masks} mask sets, features averaged"] = gaussian_distance(fit.mean(0), val.mean(0), STUDY)
        pooled = fit.flatten(0, 1)
        out[f"{masks} mask sets, distances averaged"] = torch.stack(
            [gaussian_distance(pooled, v, STUDY) for v in val]
        ).mean(0)
    return out


def recon_mean(model, x: torch.Tensor, seed: int) -> torch.Tensor:
    maps = in_batches(lambda b: anomaly_maps(model, b, masks=4, seed=seed)[0], x, BATCH)
    return aggregate(maps, "mean").double()


def standardised(fit: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`query` in units of `fit`'s spread: scores of different scales summed on equal terms."""
    return (query - fit.mean()) / fit.std()


def scoring_levers(model, fit_x: torch.Tensor, val_x: torch.Tensor, seed: int, recon: bool) -> dict:
    """{lever: val scores} of one model (`recon`: also the fusions with its reconstruction score)."""
    (fit_b, fit_cls, fit_p), (val_b, val_cls, val_p) = block_features(model, fit_x), block_features(model, val_x)
    fit_flip, val_flip = block_features(model, fit_x.flip(-1))[0], block_features(model, val_x.flip(-1))[0]
    fit, val, blocks = fit_b[-1], val_b[-1], len(fit_b)
    study = gaussian_distance(fit, val, STUDY).double()
    out = {f"last block, shrinkage {s:g}": gaussian_distance(fit, val, s) for s in FINER + SHRINKAGES}
    for b in range(blocks - 1):
        for s in SHRINKAGES:
            out[f"block {b + 1}, shrinkage {s:g}"] = gaussian_distance(fit_b[b], val_b[b], s)
            cat_fit, cat_val = fit_b[b:].permute(1, 0, 2).flatten(1), val_b[b:].permute(1, 0, 2).flatten(1)
            out[f"blocks {b + 1}-{blocks}, shrinkage {s:g}"] = gaussian_distance(cat_fit, cat_val, s)
    for s in SHRINKAGES:
        positions = position_distance(fit_p, val_p, s)
        out[f"per patch position, shrinkage {s:g}, mean"] = positions.mean(1)
        out[f"per patch position, shrinkage {s:g}, max"] = positions.amax(1)
    out["CLS token"] = gaussian_distance(fit_cls, val_cls, STUDY)
    out["mean and CLS"] = gaussian_distance(torch.cat([fit, fit_cls], 1), torch.cat([val, val_cls], 1), STUDY)
    out["flip-averaged features"] = gaussian_distance((fit + fit_flip[-1]) / 2, (val + val_flip[-1]) / 2, STUDY)
    out["flipped fit images added"] = gaussian_distance(torch.cat([fit, fit_flip[-1]]), val, STUDY)
    study_fit = gaussian_distance(fit, fit, STUDY).double()
    # On the fit images themselves the k-NN's nearest is the image: its k + 1 nearest less itself.
    knn_val, knn_fit = knn_distance(fit, val, K).double(), knn_distance(fit, fit, K + 1).double() * (K + 1) / K
    for w in FUSE_KNN:
        out[f"+ {w:g} x k-NN"] = standardised(study_fit, study) + w * standardised(knn_fit, knn_val)
    out |= masked_levers(model, fit_x, val_x, seed)
    if recon:
        recon_val, recon_fit = recon_mean(model, val_x, seed), recon_mean(model, fit_x, seed)
        for w in FUSE_RECON:
            out[f"+ {w:g} x reconstruction"] = standardised(study_fit, study) + w * standardised(recon_fit, recon_val)
    return out


def pixel_levers(fit_x: torch.Tensor, val_x: torch.Tensor, patch_size: tuple[int, int]) -> dict:
    """{lever: val scores} on raw pixels, no model: the Gaussian per patch position on the pixels of each patch
    (the encoder's patches), beside one Gaussian on all pixels, to tell a model's per-position gain from the
    positions' own."""
    fit_p, val_p = (F.unfold(x, patch_size, stride=patch_size).transpose(1, 2) for x in (fit_x, val_x))
    out = {f"raw pixels, shrinkage {s:g}": gaussian_distance(fit_x.flatten(1), val_x.flatten(1), s) for s in SHRINKAGES}
    for s in SHRINKAGES:
        out[f"raw pixels per patch position, shrinkage {s:g}, mean"] = position_distance(fit_p, val_p, s).mean(1)
    return out


def study_gaussian(run: Path, fit: np.ndarray, val: np.ndarray, model=None, masks: int = 0) -> torch.Tensor:
    """The study's Gaussian score of the run's MAE (or of `model`, e.g. its random-init twin), on the run's
    normalisation: on the whole image's features, or with `masks` on its masked views' (`--features masked`)."""
    cfg = run_config(run)
    stats, seed = cfg["data"], cfg["seed"]
    model = load_with_decoder(run) if model is None else model
    features = [
        masked_features(model, x, masks, seed).mean(0) if masks else block_features(model, x)[0][-1]
        for x in (as_input(v, stats["mean"], stats["std"]) for v in (fit, val))
    ]
    return gaussian_distance(*features, STUDY)


def study_positions(run: Path, fit: np.ndarray, val: np.ndarray, model=None) -> torch.Tensor:
    """The study's Gaussian per patch position (the MAE's score chosen on val since it was scored), averaged over
    positions, of the run's MAE or of `model`, on the run's normalisation."""
    stats = run_config(run)["data"]
    model = load_with_decoder(run) if model is None else model
    model.eval()
    bank, query = (in_batches(lambda b: patch_tokens(model, b), as_input(x, stats["mean"], stats["std"]), BATCH)
                   for x in (fit, val))  # fmt: skip
    return position_distance(bank, query, STUDY).mean(1)


def kept_rows(path: Path, classes: list[int], seed: int) -> dict:
    """The rows an earlier call wrote to `path` for the same classes and seed, which this call's rows join (so
    levers screened one call at a time end in one file); {} when there is none. A file of other classes or another
    seed ends the run with one line, before anything runs: its rows are not comparable, and not to be lost."""
    if not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
        kept_classes, kept_seed, rows = kept["classes"], kept["seed"], kept["val"]
        if not isinstance(rows, dict):
            raise TypeError("its val is not an object")
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"{path}: not a levers file ({type(e).__name__}: {e}); move it aside to measure here")
    if (kept_classes, kept_seed) != (classes, seed):
        theirs, ours = (" ".join(map(str, c)) for c in (kept_classes, classes))
        sys.exit(f"{path}: holds --classes {theirs} --seed {kept_seed}, not --classes {ours} --seed {seed}; use "
                 "those, or move the file aside to keep its rows")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEBIAN, help="folder of the four IDX files")
    parser.add_argument("--output", type=Path, default=Path("runs/anomaly_study"), help="the study's run folders")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--classes", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--scoring", type=lambda s: {"true": True, "false": False}[s.lower()], default=True,
                        help="measure the scoring levers (false: the --variant ones only)")  # fmt: skip
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="a recipe change: its overrides as mae.pretrain takes them")  # fmt: skip
    args = parser.parse_args()
    variants = {}
    for v in args.variant:
        name, _, overrides = v.partition("=")
        try:
            variants[name] = recipe_change(overrides)
        except ValueError as e:
            sys.exit(f"--variant {v}: not NAME=JSON ({e})")
        except TypeError:
            sys.exit(f"--variant {v}: not NAME=JSON with a JSON object, e.g. " + '\'{"model": {"mask_ratio": 0.5}}\'')
    result_path = args.output / f"levers_seed{args.seed}.json"
    kept = kept_rows(result_path, args.classes, args.seed)  # before anything runs
    for c in args.classes:
        run = args.output / f"class{c}_seed{args.seed}"
        if not (run / "encoder.safetensors").exists():
            sys.exit(f"{run}: no study run; pretrain it first: python scripts/anomaly_study.py --output "
                     f"{args.output} --classes {c} --seeds {args.seed}")  # fmt: skip
    train_x, train_y = load_split(args.source, "train")
    rows: dict = {}
    for c in args.classes:
        run = args.output / f"class{c}_seed{args.seed}"
        fit, val_x, anomalous = split(train_x, train_y, c, args.seed)
        study_mae = load_with_decoder(run)
        if variants:  # first: a bad override ends the run before any scoring is lost
            study = {m: auroc(study_gaussian(run, fit, val_x, study_mae, m).numpy(), anomalous) for m in VARIANT_MASKS}
            study_per_position = auroc(study_positions(run, fit, val_x, study_mae).numpy(), anomalous)
            folder = write_class_folder(fit, args.output / "classes" / f"{c}_seed{args.seed}")
        for name, overrides in variants.items():
            vrun = args.output / "variants" / name / f"class{c}_seed{args.seed}"
            if not (vrun / "encoder.safetensors").exists():
                try:
                    pretrain_class(folder, vrun, args.seed, overrides)
                except mae.MaeError as e:
                    sys.exit(f"--variant {name}: {e}")
            # beside the variant's own baseline: its architecture, fresh weights (the study's, where it keeps that)
            pair = (("mae", load_with_decoder(vrun)), ("random-init", random_like(vrun, args.seed)))
            for masks, features in VARIANT_MASKS.items():
                row = rows.setdefault(f"recipe: {name}{features}", {})
                for who, model in pair:
                    scores = study_gaussian(vrun, fit, val_x, model, masks).numpy()
                    row.setdefault(who, []).append(auroc(scores, anomalous))
                row.setdefault("study's recipe", []).append(study[masks])
            row = rows.setdefault(f"recipe: {name}, per patch position", {})
            for who, model in pair:
                row.setdefault(who, []).append(auroc(study_positions(vrun, fit, val_x, model).numpy(), anomalous))
            row.setdefault("study's recipe", []).append(study_per_position)
        if args.scoring:
            stats = run_config(run)["data"]
            fit_t, val_t = (as_input(x, stats["mean"], stats["std"]) for x in (fit, val_x))
            for name, model in (("mae", study_mae), ("random-init", random_like(run, args.seed))):
                for lever, scores in scoring_levers(model, fit_t, val_t, args.seed, name == "mae").items():
                    rows.setdefault(lever, {}).setdefault(name, []).append(auroc(scores.numpy(), anomalous))
            for lever, scores in pixel_levers(fit_t, val_t, study_mae.encoder.patch_embed.patch_size).items():
                rows.setdefault(lever, {}).setdefault("raw pixels", []).append(auroc(scores.numpy(), anomalous))
        print(f"class {c} done", flush=True)
    whole = kept | rows  # a lever measured again replaces its kept row
    write_whole(result_path, json.dumps({"classes": args.classes, "seed": args.seed, "val": whole}, indent=1))
    print(f"val AUROC, mean over classes {args.classes} (seed {args.seed}); {result_path}")
    for lever, by_model in whole.items():
        means = {m: 100 * float(np.mean(v)) for m, v in by_model.items()}
        cells = "  ".join(f"{m} {v:.2f}" for m, v in means.items())
        margin = f"  margin {means['mae'] - means['random-init']:+.2f}" if "random-init" in means else ""
        if "study's recipe" in means:
            gain = means["mae"] - means["study's recipe"]
            margin += f"  vs the study's recipe {gain:+.2f}"
        print(f"  {lever:36s} {cells}{margin}")


if __name__ == "__main__":
    main()
