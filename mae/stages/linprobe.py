"""`mae linprobe`: the paper's linear probe (BatchNorm without affine + a linear layer) on the frozen encoder's
features, cached once (`--mode cached`) or through the encoder with the paper's crops (`augmented`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from timm.optim import Lars

from mae.config import LARS_MIN_BATCH, ConfigError, LinprobeConfig
from mae.data.labeled import LabeledSamples
from mae.data.open import recorded_path
from mae.data.transforms import collate_labeled, crop_decode_side, decode_side, train_transform
from mae.models.classifier import LinearProbe, build_classifier, fold_probe_head, probe_head
from mae.models.encoder import encoder_adapter
from mae.stages.downstream import (
    Downstream,
    eval_transform,
    labeled_eval_loader,
    open_downstream,
    save_run_classifier,
)
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import plain_model, warn
from mae.train.feature_cache import FeatureCache, data_fingerprint, weights_digest
from mae.train.features import predict
from mae.train.loaders import make_loader, prepare_eval
from mae.train.optim import effective_batch
from mae.train.speed import configure_speed
from mae.train.tasks import ClassifierTask
from mae.train.trainer import train


@register_stage("linprobe", LinprobeConfig, "Train a linear classifier on the frozen encoder's features.")
def run_linprobe(cfg: LinprobeConfig) -> StageResult:
    """Train BN + linear on frozen features; the encoder never changes (it stays in eval mode)."""
    setup = open_downstream(cfg)
    accelerator, classes = setup.accelerator, setup.classes
    kw = dict(img_size=cfg.model.img_size, global_pool=cfg.model.pool, fc_norm=False)
    encoder, arch, args = build_classifier(setup.encoder, 0, **kw)
    encoder.requires_grad_(False).eval().to(accelerator.device)
    configure_speed(encoder, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    head = probe_head(encoder.num_features, len(classes))
    mode = cfg.mode if cfg.mode != "auto" else ("augmented" if cfg.augment else "cached")
    if mode == "cached" and cfg.augment:
        raise ConfigError("--mode cached: cached features cannot be augmented; use --mode augmented or --augment false")
    train_ds, val_ds, model, workers = probe_data(cfg, setup, encoder, head, mode)
    val_loader = make_loader(
        val_ds, batch_size=cfg.loop.batch_size, drop_last=False, collate_fn=collate_labeled, num_workers=workers
    )
    opt_name = probe_optimizer_name(cfg.optim, effective_batch(cfg, accelerator.num_processes), accelerator)
    model, task = train(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=train_ds,
        collate_fn=collate_labeled,
        num_workers=workers,
        optimizer=lambda m, lr: probe_optimizer(head, cfg.optim, lr, opt_name),  # the head alone trains
        task=lambda m, val: ClassifierTask(
            m, accelerator=accelerator, criterion=torch.nn.CrossEntropyLoss(), val_loader=val
        ),
        title=(
            f"linear probe of a {encoder_adapter(encoder).describe()} ({mode}, pool {cfg.model.pool}, {opt_name}) on "
            f"{len(train_ds)} images, {len(classes)} classes"
        ),
        resume_from=setup.resume_from,
        val_loader=val_loader,
    )
    classifier, arch, args = build_classifier(setup.encoder, len(classes), **kw)
    classifier.head = fold_probe_head(plain_model(accelerator, model) if mode == "cached" else head)
    path = save_run_classifier(setup, cfg, classifier, arch, args)
    return StageResult(Path(cfg.output_dir), task.last_evaluation, path)


def probe_data(cfg: LinprobeConfig, setup: Downstream, encoder: torch.nn.Module, head: torch.nn.Module, mode: str):
    """(training samples, validation samples, the module that trains, loader workers) of a probe: cached
    features and the head alone, or images through the frozen encoder (`LinearProbe`)."""
    eval_tf = eval_transform(setup, cfg)
    if mode == "cached":
        cache = feature_cache(cfg, setup) if cfg.cache_dir else None
        train_feats = _cached(setup, cfg, encoder, setup.train, cache, "train")
        val_feats = _cached(setup, cfg, encoder, setup.val, cache, "val")
        if cache is not None and not cache.reusable and setup.accelerator.is_main_process:
            cache.seal()
        return FeatureSamples(*train_feats), FeatureSamples(*val_feats), head, 0
    c, size = setup.in_chans, setup.size
    if cfg.augment:
        train_tf = train_transform(size, scale=(0.08, 1.0), mean=setup.mean, std=setup.std, in_chans=c)
        side = crop_decode_side(size, 0.08)
    else:
        train_tf, side = eval_tf, decode_side(size, cfg.data.crop_pct)
    train_ds = LabeledSamples(setup.train, train_tf, seed=cfg.seed, decode_side=side, in_chans=c)
    val_ds = LabeledSamples(setup.val, eval_tf, decode_side=decode_side(size, cfg.data.crop_pct), in_chans=c)
    return train_ds, val_ds, LinearProbe(encoder, head), cfg.data.num_workers


class FeatureSamples(torch.utils.data.Dataset):
    """Cached features as a dataset keyed like the image ones ((epoch, index) or index)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        return {"image": self.features[index], "label": int(self.labels[index]), "index": index}


def feature_cache(cfg: LinprobeConfig, setup: Downstream) -> FeatureCache:
    """--cache_dir, and whether the features there are this run's (decided by every process before any writes)."""
    path = recorded_path(cfg.data.path)  # a datasets.Dataset object as its stand-in: the record is JSON
    held_out = f"{path} (held out: val_fraction {cfg.data.val_fraction}, seed {cfg.seed})"
    val = recorded_path(cfg.data.val_path) or held_out
    record = {
        "pretrained": cfg.pretrained,  # for readers: the encoder is known by its weights, wherever they were read
        "encoder": {
            "weights_sha256": weights_digest(setup.encoder.state),
            "architecture": setup.encoder.arch,
            "precision": setup.accelerator.mixed_precision,
        },
        "data": {
            "train": {"path": path, **data_fingerprint(setup.train)},
            "val": {"path": val, **data_fingerprint(setup.val)},
        },
        "transform": {
            "img_size": list(setup.size),
            "crop_pct": cfg.data.crop_pct,
            "mean": list(setup.mean),
            "std": list(setup.std),
            "in_chans": setup.in_chans,
            "pool": cfg.model.pool,
        },
    }
    cache = FeatureCache(cfg.cache_dir, record)
    cache.decide(("train", "val"), setup.accelerator.print)
    setup.accelerator.wait_for_everyone()  # every process has read the old record before the main one rewrites it
    return cache


def _cached(setup: Downstream, cfg: Any, encoder, source, cache: FeatureCache | None, name: str):
    """(features, labels) of a labeled source, computed once (and kept on disk, memory-mapped, with `cache`)."""
    if cache is not None and cache.reusable:
        return cache.read(name)
    accelerator = setup.accelerator
    feats, labels = predict(encoder, prepare_eval(accelerator, labeled_eval_loader(setup, source, cfg)), accelerator)
    if cache is not None and accelerator.is_main_process:
        cache.write(name, feats, labels)
    return feats, labels


def probe_optimizer_name(optim: Any, eff_batch: int, accelerator: Any) -> str:
    """--optim.optimizer, with auto resolved by the effective batch (LARS needs large ones)."""
    if optim.optimizer == "auto":
        return "lars" if eff_batch >= LARS_MIN_BATCH else "sgd"
    if optim.optimizer == "lars" and eff_batch < LARS_MIN_BATCH:
        warn(
            accelerator,
            f"--optim.optimizer lars at an effective batch of {eff_batch}: LARS's trust ratio makes tiny steps "
            f"below {LARS_MIN_BATCH}; use --optim.optimizer auto or sgd",
        )
    return optim.optimizer


def probe_optimizer(head: torch.nn.Sequential, optim: Any, lr: float, name: str) -> torch.optim.Optimizer:
    """The head's optimizer; biases are never decayed (nor, with LARS, adapted by the trust ratio)."""
    fc = head[1]
    if name == "lars":  # as the paper's LARS: the trust ratio applies to the weight matrix only
        groups = [{"params": [fc.weight], "always_adapt": True}, {"params": [fc.bias], "weight_decay": 0.0}]
        return Lars(groups, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    groups = [{"params": [fc.weight]}, {"params": [fc.bias], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim.momentum, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=optim.weight_decay)
