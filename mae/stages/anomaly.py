"""`mae anomaly`: anomaly maps and scores of images under a pretraining run (`mae.anomaly_maps` does the maths).

Reads the images as the run was trained (its mean/std, resized to the model's input), runs one evaluation pass
over every process (`features.predict`, gathered exactly), and writes scores.csv, maps/, most_anomalous.png and,
where the data says what is normal, metrics.json with image (and pixel) AUROC and AUPR, and roc.png.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mae.anomaly_maps import (
    NEEDS_DECODER,
    aggregate,
    auroc,
    average_precision,
    encoder_features,
    error_maps,
    gaussian_distance,
    knn_distance,
    load_with_decoder,
    patch_tokens,
    position_distance,
    position_maps,
    roc_curve,
)
from mae.config import AnomalyConfig, ConfigError
from mae.data.labeled import LabeledSamples, Subset
from mae.data.open import open_source
from mae.data.transforms import collate_labeled, normalize, resized_crop
from mae.errors import CheckpointError
from mae.run_folder import ANOMALY_METRICS, MAPS, MOST_ANOMALOUS, ROC, SCORES, run_config
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import open_accelerator
from mae.train.checkpoint import check_output_dir
from mae.train.features import predict
from mae.train.loaders import eval_loader, prepare_eval
from mae.weights.importers import load_noting_decoder

# The columns each --score writes, in order (the first is the one metrics.json's auroc/aupr and roc.png judge).
SCORE_COLUMNS = {"recon": ("recon",), "knn": ("knn",), "gaussian": ("gaussian",), "both": ("recon", "knn"),
                 "all": ("recon", "knn", "gaussian")}  # fmt: skip


@register_stage("anomaly", AnomalyConfig, "Anomaly maps and scores: reconstruction error, or feature distance.")
def run_anomaly(cfg: AnomalyConfig) -> StageResult:
    """Score every image of --data.path; write scores, maps, figures and (with known normals) AUROC / AUPR."""
    columns = SCORE_COLUMNS[cfg.score]
    recon, features = "recon" in columns, any(c != "recon" for c in columns)
    if cfg.features == "positions" and "knn" in columns:
        raise ConfigError(f"--features positions: a Gaussian per patch position, for --score gaussian; with --score "
                          f"{cfg.score} (k-NN) give --features full or masked")  # fmt: skip
    model, mean, std = open_model(cfg)
    source = open_source(cfg.data.path, labeled=None, image_column=cfg.data.image_column,
                         label_column=cfg.data.label_column)  # fmt: skip
    normal = normal_class(cfg, source)
    train = open_train(cfg) if features else None
    check_output_dir(cfg)
    accelerator = open_accelerator(cfg)
    model.to(accelerator.device)
    size = tuple(model.img_size)
    net = ImageOutputs(model, maps=recon, features=features, cfg=cfg)
    out, positions = predict(net, prepare_eval(accelerator, loader(source, cfg, size, mean, std, model.in_chans)),
                             accelerator)  # fmt: skip
    pixels = size[0] * size[1]
    maps = out[:, :pixels].view(-1, *size) if recon else None
    scores = {}
    if recon:
        scores["recon"] = aggregate(maps, cfg.aggregate, cfg.top_percent)
    if features:
        net = ImageOutputs(model, maps=False, features=True, cfg=cfg)
        bank, _ = predict(net, prepare_eval(accelerator, loader(train, cfg, size, mean, std, model.in_chans)),
                          accelerator)  # fmt: skip
        query = out[:, pixels if recon else 0 :]
        if "knn" in columns:
            scores["knn"] = knn_distance(bank, query, cfg.k)
        if "gaussian" in columns and cfg.features == "positions":
            shape = (model.num_patches, -1)  # the rows: each position's tokens, flattened
            distances = position_distance(bank.view(len(bank), *shape), query.view(len(query), *shape), cfg.shrinkage)
            scores["gaussian"] = distances.mean(1)
            if not recon:  # the map of the one score: each patch's distance
                maps = position_maps(distances, model)
        elif "gaussian" in columns:
            scores["gaussian"] = gaussian_distance(bank, query, cfg.shrinkage)
    positions = positions.numpy()
    anomalous = None if normal is None else source.labels[positions] != normal
    metrics = judge(scores, anomalous, len(source) - len(positions))
    out_dir = Path(cfg.output_dir)
    if accelerator.is_main_process:
        writer = Writer(cfg, source, positions, (size, mean, std, model.in_chans))
        writer.scores(scores, anomalous)
        if maps is not None:
            gt = ground_truth(source, positions, size)
            if gt is not None:
                metrics.update(pixel_auroc=auroc(maps[gt[0]].numpy(), gt[1]), pixel_images=int(len(gt[0])))
            writer.maps(maps, scores["recon" if recon else "gaussian"])
        writer.metrics(metrics, scores, anomalous)
        summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "auroc" in k or "aupr" in k)
        accelerator.print(f"anomaly: {len(positions)} images scored in {out_dir}" + (f"; {summary}" if summary else ""))
    accelerator.end_training()
    return StageResult(out_dir, metrics)


def open_model(cfg: AnomalyConfig):
    """(the MAE, with its trained decoder where a score needs it, mean, std): statistics from --data.mean/std, else
    the model record's (`ModelSpec.input_stats`: recorded, or ImageNet's for 3 channels)."""
    if not cfg.pretrained:
        raise ConfigError(
            "--pretrained: required: a pretraining output folder, or a checkpoint with its decoder (an encoder alone "
            "for --score knn or gaussian)"
        )
    if not Path(cfg.pretrained).exists():
        raise ConfigError(f"--pretrained {cfg.pretrained}: no such file or folder")
    recon = "recon" in SCORE_COLUMNS[cfg.score]  # the feature scores read the encoder alone
    try:
        model = load_with_decoder(cfg.pretrained) if recon else load_noting_decoder(cfg.pretrained)[0]
    except CheckpointError as e:
        if NEEDS_DECODER in str(e):
            raise ConfigError(
                f"--pretrained {cfg.pretrained} {NEEDS_DECODER}, or use --score knn or gaussian (the encoder alone) "
                f"instead of --score {cfg.score}"
            ) from None
        raise ConfigError(f"--pretrained {cfg.pretrained}: {e}") from None
    if cfg.masks > model.num_patches:
        raise ConfigError(f"--masks {cfg.masks}: at most {model.num_patches}, the model's patch count")
    recorded = model.spec.input_stats() or (None, None)  # the model record's rule for unrecorded statistics
    mean, std = cfg.data.mean or recorded[0], cfg.data.std or recorded[1]
    for name, value in (("mean", mean), ("std", std)):
        if value is None or len(value) != model.in_chans:
            raise ConfigError(
                f"--data.{name}: the run at {cfg.pretrained} does not record {model.in_chans} value(s) for its "
                f"{model.in_chans} channel(s); give them (e.g. from `mae stats`)"
            )
    return model, tuple(mean), tuple(std)


def normal_class(cfg: AnomalyConfig, source: Any) -> int | None:
    """The label of the normal class: --normal, else a class named normal or good; None where unknown."""
    classes = list(getattr(source, "classes", None) or [])
    if cfg.normal is not None:
        if not classes:
            raise ConfigError(
                f"--normal {cfg.normal}: --data.path {cfg.data.path} has no classes; give a folder with one "
                "subfolder per class (or a labeled dataset)"
            )
        if cfg.normal not in classes:
            raise ConfigError(f"--normal {cfg.normal}: not a class of --data.path (its classes: {', '.join(classes)})")
        return classes.index(cfg.normal)
    return next((classes.index(n) for n in ("normal", "good") if n in classes), None)


def open_train(cfg: AnomalyConfig) -> Any:
    """The normal training images the feature scores compare with: --train_path, or the run's."""
    path = cfg.train_path or ((run_config(cfg.pretrained) or {}).get("data") or {}).get("path")
    if not path:
        raise ConfigError(
            f"--train_path: required with --score {cfg.score}: the run at {cfg.pretrained} records no data.path; "
            "give the normal training images"
        )
    return open_source(path, labeled=False, option="--train_path")


class Positions(Subset):
    """Every row of a source, labeled by its own position: `predict` hands the positions back beside the outputs,
    so each result finds its file whatever was unreadable and whatever the processes."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.indices = self.labels = np.arange(len(source))
        self.classes = []


def input_transform(size: tuple[int, int], mean: tuple, std: tuple):
    """An image (PIL, or a float tensor [C, H, W] in [0, 1]) resized whole to the model's `size` (no crop, so a
    map lies over the whole image) and normalised."""
    from torchvision.transforms.v2 import functional as F

    def transform(img: Any) -> torch.Tensor:
        x = img if isinstance(img, torch.Tensor) else F.pil_to_tensor(img)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        x = resized_crop(x, 0, 0, x.shape[-2], x.shape[-1], size)
        return normalize(x[None], mean, std)[0]

    return transform


def samples(source: Any, size: tuple[int, int], mean: tuple, std: tuple, in_chans: int) -> LabeledSamples:
    return LabeledSamples(Positions(source), input_transform(size, mean, std), in_chans=in_chans)


def loader(source: Any, cfg: AnomalyConfig, size: tuple[int, int], mean: tuple, std: tuple, in_chans: int):
    return eval_loader(
        source,
        lambda src, **kw: samples(src, size, mean, std, in_chans),
        collate_labeled,
        batch_size=cfg.loop.batch_size,
        num_workers=cfg.data.num_workers,
    )


class ImageOutputs(nn.Module):
    """Images -> one row each for `predict` to gather: the flattened map [H * W], then the encoder features [D]
    (with --features positions, every position's tokens [L * D])."""

    def __init__(self, model: nn.Module, *, maps: bool, features: bool, cfg: AnomalyConfig) -> None:
        super().__init__()
        self.model, self.maps, self.features, self.masks, self.seed = model, maps, features, cfg.masks, cfg.seed
        self.feature_masks = cfg.masks if cfg.features == "masked" else 0
        self.positions = cfg.features == "positions"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        parts = [error_maps(self.model, images, self.masks, self.seed).flatten(1)] if self.maps else []
        if self.features and self.positions:
            parts.append(patch_tokens(self.model, images).flatten(1))
        elif self.features:
            parts.append(encoder_features(self.model, images, self.feature_masks, self.seed))
        return torch.cat(parts, 1)


def judge(scores: dict[str, torch.Tensor], anomalous: np.ndarray | None, unreadable: int) -> dict[str, Any]:
    """Counts, and image AUROC / AUPR of each score where the normal class is known (the first score's also as
    `auroc` / `aupr`)."""
    n = len(next(iter(scores.values())))
    metrics: dict[str, Any] = {"images": n, "unreadable": unreadable}
    if anomalous is None:
        return metrics
    metrics.update(normal=int((~anomalous).sum()), anomalous=int(anomalous.sum()))
    for i, (name, s) in enumerate(scores.items()):
        a, p = auroc(s.numpy(), anomalous), average_precision(s.numpy(), anomalous)
        if i == 0:
            metrics.update(auroc=a, aupr=p)
        metrics.update({f"{name}_auroc": a, f"{name}_aupr": p})
    return metrics


def ground_truth(source: Any, positions: np.ndarray, size: tuple[int, int]):
    """(rows, masks [M, H, W] bool) from MVTec AD's layout, `ground_truth/<defect>/<name>_mask.png` beside
    `test/<defect>/<name>.png`, resized as the images are: rows with a mask file, and the normal rows
    (class good/normal: all zero). None where no mask file exists."""
    from PIL import Image

    classes = list(getattr(source, "classes", None) or [])
    rows, masks, found = [], [], False
    for row, pos in enumerate(positions):
        path = Path(source.name(int(pos)))
        file = path.parent.parent.parent / "ground_truth" / path.parent.name / f"{path.stem}_mask.png"
        if file.is_file():
            found = True
            m = torch.from_numpy(np.asarray(Image.open(file).convert("L"), dtype=np.float32))[None, None]
            masks.append(torch.nn.functional.interpolate(m, size=list(size), mode="nearest")[0, 0] > 127)
            rows.append(row)
        elif classes and classes[source.labels[pos]] in ("good", "normal"):
            masks.append(torch.zeros(size, dtype=torch.bool))
            rows.append(row)
    return (torch.tensor(rows), torch.stack(masks).numpy()) if found else None


def map_name(name: str, root: Any) -> str:
    """A file name for an image's map: its path below --data.path (or its source name), without extension,
    folders joined by `__`."""
    if isinstance(root, str) and root and name.startswith(str(Path(root))):  # not a datasets.Dataset object
        name = name[len(str(Path(root))) :].lstrip("/")
    stem = re.sub(r"\.[A-Za-z0-9]+$", "", name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace("/", "__")).strip("_") or "image"


class Writer:
    """What the main process writes: scores.csv, metrics.json, roc.png, maps/, most_anomalous.png."""

    def __init__(self, cfg: AnomalyConfig, source: Any, positions: np.ndarray, reading: tuple) -> None:
        self.cfg, self.source, self.positions = cfg, source, positions
        self.out = Path(cfg.output_dir)
        self.names = [source.name(int(p)) for p in positions]
        self.reading = reading  # (size, mean, std, in_chans): how the images are read again for figures

    def scores(self, scores: dict[str, torch.Tensor], anomalous: np.ndarray | None) -> None:
        ranks = {k: _ranks(v) for k, v in scores.items()}
        single = len(scores) == 1
        header = ["file"] + [c for k in scores for c in (["score", "rank"] if single else [f"{k}_score", f"{k}_rank"])]
        classes = list(getattr(self.source, "classes", None) or [])
        header += (["class"] if classes else []) + (["anomalous"] if anomalous is not None else [])
        first = next(iter(ranks.values()))
        with (self.out / SCORES).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for row in np.argsort(first, kind="stable"):
                cells = [self.names[row]]
                for k, s in scores.items():
                    cells += [f"{s[row].item():.6g}", int(ranks[k][row])]
                cells += [classes[self.source.labels[self.positions[row]]]] if classes else []
                cells += [int(anomalous[row])] if anomalous is not None else []
                w.writerow(cells)

    def metrics(self, metrics: dict[str, Any], scores: dict[str, torch.Tensor], anomalous: np.ndarray | None) -> None:
        cfg = self.cfg
        settings = {"score": cfg.score, "masks": cfg.masks, "aggregate": cfg.aggregate, "top_percent": cfg.top_percent,
                    "k": cfg.k, "shrinkage": cfg.shrinkage, "features": cfg.features, "seed": cfg.seed}  # fmt: skip
        (self.out / ANOMALY_METRICS).write_text(json.dumps({**metrics, **settings}, indent=1))
        if anomalous is not None and "auroc" in metrics:
            from mae.figures import roc_figure

            name, s = next(iter(scores.items()))
            fpr, tpr = roc_curve(s.numpy(), anomalous)
            roc_figure(fpr, tpr, self.out / ROC, f"{name}: AUROC {metrics['auroc']:.3f}, AUPR {metrics['aupr']:.3f}")

    def images(self, rows) -> torch.Tensor:
        """The images at `rows`, read again as the model saw them, as RGB in [0, 1] [n, 3, H, W]."""
        from mae.data.transforms import denormalize
        from mae.figures import as_rgb

        size, mean, std, in_chans = self.reading
        ds = samples(self.source, size, mean, std, in_chans)
        x = torch.stack([ds[int(self.positions[r])]["image"] for r in rows])
        return as_rgb(denormalize(x, mean, std))

    def maps(self, maps: torch.Tensor, scores: torch.Tensor) -> None:
        """maps/<name>.npy and .png (on one scale for all: the 99.9th percentile of every map's pixels), and the
        most anomalous images with their maps."""
        from torchvision.utils import make_grid

        from mae.figures import enlarge, heat_colour, heat_overlay, save_grid

        sample = maps.flatten()[torch.randperm(maps.numel(), generator=torch.Generator().manual_seed(0))[: 10**6]]
        top = sample.quantile(0.999).clamp_min(1e-12)
        heat = (maps / top).clamp(0, 1).unsqueeze(1)  # [N, 1, H, W]
        if self.cfg.save_maps:
            folder = self.out / MAPS
            folder.mkdir(parents=True, exist_ok=True)
            for start in range(0, len(maps), 256):
                rows = range(start, min(start + 256, len(maps)))
                overlays = heat_overlay(self.images(rows), heat[start : rows.stop])
                for r, overlay in zip(rows, overlays, strict=True):
                    name = map_name(self.names[r], self.cfg.data.path)
                    np.save(folder / f"{name}.npy", maps[r].numpy())
                    save_grid(overlay, folder / f"{name}.png")
        worst = torch.argsort(scores, descending=True, stable=True)[: self.cfg.figure_images].tolist()
        original = self.images(worst)
        rows = torch.stack([original, heat_overlay(original, heat[worst]), heat_colour(heat[worst])], 1)
        # small images (28-px) enlarged to at least 128 px a side, as in the reconstruction previews
        figure = make_grid(enlarge(rows.flatten(0, 1)), nrow=3, padding=2, pad_value=1.0)
        save_grid(figure, self.out / MOST_ANOMALOUS)


def _ranks(scores: torch.Tensor) -> np.ndarray:
    """1 = the highest score (ties in file order)."""
    order = torch.argsort(scores, descending=True, stable=True).numpy()
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(1, len(order) + 1)
    return ranks
