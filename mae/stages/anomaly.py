"""`mae anomaly`: anomaly maps and scores of images under a pretraining run (`mae.anomaly_maps` does the maths).

Reads the images as the run was trained (its mean/std, resized to the model's input), runs one evaluation pass
over every process (`features.predict`, gathered exactly), and writes scores.csv, maps/, most_anomalous.png and,
where the data says what is normal, metrics.json with image AUROC and AUPR (with masks, pixel AUROC and PRO), and
roc.png. With no --score it chooses from what it knows (`choose`), and says so first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    pro_auc,
)
from mae.config import AnomalyConfig, ConfigError
from mae.data.open import open_source
from mae.data.transforms import collate_labeled
from mae.errors import CheckpointError
from mae.run_folder import run_config
from mae.stages.anomaly_io import Writer, ground_truth, input_transform, samples
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import close_accelerator, open_accelerator
from mae.train.checkpoint import check_output_dir
from mae.train.features import predict
from mae.train.loaders import eval_loader, prepare_eval
from mae.weights.importers import load_noting_decoder

__all__ = ["Choice", "choose", "input_transform", "run_anomaly"]

# The columns each --score writes, in order (the first is the one metrics.json's auroc/aupr and roc.png judge).
SCORE_COLUMNS = {"recon": ("recon",), "knn": ("knn",), "gaussian": ("gaussian",), "both": ("recon", "knn"),
                 "all": ("recon", "knn", "gaussian")}  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """The score a run uses and why: `--score` as given, or, with none, what suits what is known."""

    score: str
    features: str
    train_path: str | None  # the normal training images, where known
    why: str
    auto: bool

    def line(self) -> str:
        what = "a Gaussian per patch position" if self.features == "positions" and self.score == "gaussian" else None
        name = f"--score {self.score}" + (f" --features {self.features}" if self.score != "recon" else "")
        return f"anomaly: scoring by {name}" + (f" ({what})" if what else "") + f": {self.why}"


def choose(cfg: AnomalyConfig) -> Choice:
    """With --score: it (features: --features, else masked). Without: where the normal training images are known
    (--train_path, or the run's recorded data.path, found here), a Gaussian per patch position, which measured best
    wherever the scores were compared (docs/anomaly.md); otherwise the reconstruction maps."""
    recorded = ((run_config(cfg.pretrained) or {}).get("data") or {}).get("path") if cfg.pretrained else None
    train = cfg.train_path or recorded
    if cfg.score is not None:
        return Choice(cfg.score, cfg.features or "masked", train, "as given", auto=False)
    if cfg.train_path:
        why = f"the normal training images are given (--train_path {cfg.train_path})"
        return Choice("gaussian", cfg.features or "positions", train, why, auto=True)
    if recorded and (str(recorded).startswith("hf:") or Path(recorded).exists()):
        why = f"the run records its normal training images ({recorded})"
        return Choice("gaussian", cfg.features or "positions", train, why, auto=True)
    known = f"the run's recorded data.path {recorded} is not found here" if recorded else "none are known"
    why = f"no normal training images ({known}); give --train_path for a Gaussian per patch position"
    return Choice("recon", cfg.features or "masked", None, why, auto=True)


@register_stage("anomaly", AnomalyConfig, "Anomaly maps and scores: reconstruction error, or feature distance.")
def run_anomaly(cfg: AnomalyConfig) -> StageResult:
    """Score every image of --data.path; write scores, maps, figures and (with known normals) AUROC / AUPR."""
    choice = choose(cfg)
    cfg = replace(cfg, score=choice.score, features=choice.features)  # resolved: what runs, and what is written
    columns = SCORE_COLUMNS[cfg.score]
    if cfg.features == "positions" and "knn" in columns:
        raise ConfigError(f"--features positions: a Gaussian per patch position, for --score gaussian; with --score "
                          f"{cfg.score} (k-NN) give --features full or masked")  # fmt: skip
    model, mean, std = open_model(cfg, choice)
    source = open_source(cfg.data.path, labeled=None, image_column=cfg.data.image_column,
                         label_column=cfg.data.label_column)  # fmt: skip
    normal = normal_class(cfg, source)
    train = open_train(cfg, choice) if any(c != "recon" for c in columns) else None
    check_output_dir(cfg)
    accelerator = open_accelerator(cfg)
    accelerator.print(choice.line())
    model.to(accelerator.device)
    reading = (tuple(model.img_size), mean, std, model.in_chans)
    maps, scores, positions = score_images(cfg, model, accelerator, source, train, reading)
    anomalous = None if normal is None else source.labels[positions] != normal
    metrics = judge(scores, anomalous, len(source) - len(positions))
    out_dir = Path(cfg.output_dir)
    if accelerator.is_main_process:
        writer = Writer(cfg, source, positions, reading)
        writer.scores(scores, anomalous)
        if maps is not None:
            gt = ground_truth(source, positions, reading[0], cfg.mask_path)
            if gt is not None:
                metrics.update(pixel_auroc=auroc(maps[gt[0]].numpy(), gt[1]), pixel_pro=pro_auc(maps[gt[0]], gt[1]),
                               pixel_images=int(len(gt[0])))  # fmt: skip
            writer.maps(maps, scores[columns[0]])
        writer.metrics({**metrics, "choice": choice.why}, scores, anomalous)
        summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "auroc" in k or "aupr" in k or "pro" in k)
        accelerator.print(f"anomaly: {len(positions)} images scored in {out_dir}" + (f"; {summary}" if summary else ""))
    close_accelerator(accelerator)
    return StageResult(out_dir, {**metrics, "score": cfg.score, "features": cfg.features, "choice": choice.why})


def score_images(cfg: AnomalyConfig, model: nn.Module, accelerator: Any, source: Any, train: Any, reading: tuple):
    """(maps [N, H, W] or None, {column: scores [N]}, positions [N] of the rows in `source`): one evaluation pass
    over the images, and with a feature score one over the training images."""
    columns = SCORE_COLUMNS[cfg.score]
    recon, features = "recon" in columns, any(c != "recon" for c in columns)
    size = reading[0]
    net = ImageOutputs(model, maps=recon, features=features, cfg=cfg)
    out, positions = predict(net, prepare_eval(accelerator, loader(source, cfg, *reading)), accelerator)
    pixels = size[0] * size[1]
    maps = out[:, :pixels].view(-1, *size) if recon else None
    scores = {}
    if recon:
        scores["recon"] = aggregate(maps, cfg.aggregate, cfg.top_percent)
    if features:
        net = ImageOutputs(model, maps=False, features=True, cfg=cfg)
        bank, _ = predict(net, prepare_eval(accelerator, loader(train, cfg, *reading)), accelerator)
        query = out[:, pixels if recon else 0 :]
        if "knn" in columns:
            scores["knn"] = knn_distance(bank, query, cfg.k)
        if "gaussian" in columns and cfg.features == "positions":
            shape = (model.num_patches, -1)  # the rows: each position's tokens, flattened
            distances = position_distance(bank.view(len(bank), *shape), query.view(len(query), *shape), cfg.shrinkage)
            scores["gaussian"] = distances.mean(1)
            if not recon:  # the map of the one score: the patches' distances, upsampled
                maps = position_maps(distances, model, cfg.blur)
        elif "gaussian" in columns:
            scores["gaussian"] = gaussian_distance(bank, query, cfg.shrinkage)
    return maps, {k: scores[k] for k in columns}, positions.numpy()


def open_model(cfg: AnomalyConfig, choice: Choice):
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
        if NEEDS_DECODER in str(e) and choice.auto:
            raise ConfigError(
                f"--pretrained {cfg.pretrained} {NEEDS_DECODER}, or --train_path (the normal training images; "
                f"the default then scores by a Gaussian per patch position from the encoder alone)"
            ) from None
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


def open_train(cfg: AnomalyConfig, choice: Choice) -> Any:
    """The normal training images the feature scores compare with: --train_path, or the run's."""
    if not choice.train_path:
        raise ConfigError(
            f"--train_path: required with --score {cfg.score}: the run at {cfg.pretrained} records no data.path; "
            "give the normal training images"
        )
    return open_source(choice.train_path, labeled=False, option="--train_path")


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
