"""Downstream stages over the one loop: linear probe, fine-tuning, k-NN."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import Lars

from mae.config import LARS_MIN_BATCH, ConfigError, FinetuneConfig, KnnConfig, LinprobeConfig, to_dict
from mae.data.labeled import LabeledSamples, split
from mae.data.open import open_source
from mae.data.streaming import StreamSamples, StreamSource
from mae.data.transforms import collate_labeled, decode_side, train_transform
from mae.data.transforms import eval_transform as labeled_eval_transform
from mae.models.classifier import LinearProbe, fold_probe_head, freeze_first_blocks, probe_head
from mae.run_folder import CLASSES, CLASSIFIER, CONFIG, METRICS
from mae.train.features import knn_scores, predict, topk_accuracy
from mae.train.metrics import MetricsWriter
from mae.train.run import (
    adamw,
    check_output_dir,
    configure_speed,
    effective_lr,
    find_resume_checkpoint,
    full_state_dict,
    launch,
    make_loader,
    maybe_compile,
    open_accelerator,
    plain_model,
    prepare_eval,
    warn,
)
from mae.train.stream_loaders import EvalStream
from mae.train.tasks import ClassifierTask
from mae.weights.export import build_classifier, describe_vit, encoder_source, save_classifier
from mae.weights.importers import CheckpointError


@dataclass
class Setup:
    """What every downstream stage starts from."""

    source: dict[str, Any]  # the encoder (see `encoder_source`)
    train_src: Any
    val_src: Any
    classes: list[str]
    size: tuple[int, int]
    mean: tuple
    std: tuple
    resume_from: Path | None
    accelerator: Any
    in_chans: int = 3


def begin(cfg: Any) -> Setup:
    """Validate, open the encoder and the labeled data, find a checkpoint to resume, start Accelerate."""
    validate(cfg)
    source = load_source(cfg)
    train_src, val_src = labeled_splits(cfg)
    size, mean, std = _input(cfg, source)
    resume_from = find_resume_checkpoint(cfg)
    in_chans = source["args"].get("in_chans", 3)
    return Setup(
        source,
        train_src,
        val_src,
        list(train_src.classes),
        size,
        mean,
        std,
        resume_from,
        open_accelerator(cfg),
        in_chans,
    )


def validate(cfg: Any) -> None:
    if not cfg.pretrained:
        raise ConfigError(
            "--pretrained: required: an encoder export, a pretraining output folder, a checkpoint "
            "(any format load_pretrained reads), or random:PRESET for a random-init baseline"
        )
    if cfg.pretrained and not cfg.pretrained.startswith("random:") and not Path(cfg.pretrained).exists():
        raise ConfigError(f"--pretrained {cfg.pretrained}: no such file or folder")
    if not cfg.data.path:
        raise ConfigError("--data.path: required: a folder with one subfolder per class, or a labeled dataset")
    check_output_dir(cfg)


def load_source(cfg: Any) -> dict[str, Any]:
    try:
        source = encoder_source(cfg.pretrained, cfg.model.img_size)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"--pretrained {cfg.pretrained}: {e}") from None
    return source


def labeled_splits(cfg: Any):
    """(train, validation) labeled sources with the same classes."""
    d = cfg.data
    if d.streaming and not d.val_path:
        raise ConfigError(
            "--data.streaming true: a stream cannot be split into training and validation data; give "
            "--data.val_path (a labeled folder, shards, or another hf: split, which is streamed too)"
        )
    columns = {"image_column": d.image_column, "label_column": d.label_column}
    train_src = open_source(d.path, labeled=True, streaming=d.streaming, **columns)
    if d.val_path:
        val_stream = d.streaming and d.val_path.startswith("hf:")
        val_src = open_source(d.val_path, labeled=True, streaming=val_stream, option="--data.val_path", **columns)
        if list(val_src.classes) != list(train_src.classes):
            raise ConfigError(
                f"--data.val_path {d.val_path}: its classes {val_src.classes[:5]}... differ from "
                f"--data.path's {train_src.classes[:5]}..."
            )
        return train_src, val_src
    return split(train_src, d.val_fraction, cfg.seed)


def _input(cfg: Any, source: dict[str, Any]) -> tuple[tuple[int, int], tuple, tuple]:
    size = cfg.model.img_size or source["args"]["img_size"]
    size = (size, size) if isinstance(size, int) else tuple(size)
    mean = tuple(cfg.data.mean or source["mean"])
    std = tuple(cfg.data.std or source["std"])
    return size, mean, std


def eval_transform(size: tuple[int, int], cfg: Any, mean: tuple, std: tuple, in_chans: int = 3):
    return labeled_eval_transform(size, crop_pct=cfg.data.crop_pct, mean=mean, std=std, in_chans=in_chans)


def eval_loader(source, transform, cfg: Any, size: tuple[int, int], in_chans: int = 3):
    if isinstance(source, StreamSource):  # this process's part of the stream, in order
        from accelerate import PartialState

        state = PartialState()
        samples = StreamSamples(
            source,
            LabeledSamples(source, transform, in_chans=in_chans).prepare,
            seed=0,
            rank=state.process_index,
            world=state.num_processes,
            in_chans=in_chans,
            shuffle=False,
        )
        return EvalStream(samples, batch_size=cfg.loop.batch_size, collate_fn=collate_labeled,
                          num_workers=cfg.data.num_workers)  # fmt: skip
    return make_loader(
        LabeledSamples(source, transform, decode_side=decode_side(size, cfg.data.crop_pct), in_chans=in_chans),
        batch_size=cfg.loop.batch_size,
        drop_last=False,
        collate_fn=collate_labeled,
        num_workers=cfg.data.num_workers,
    )


def _finish(accelerator, cfg, model, arch, args, classes, mean, std, state=None) -> Path:
    """Write classes.json and the classifier (its weights from `state`, a gathered full state dict, when
    given; else from `model`) on the main process."""
    out = Path(cfg.output_dir)
    accelerator.wait_for_everyone()
    path = out / CLASSIFIER
    if accelerator.is_main_process:
        (out / CLASSES).write_text(json.dumps(classes))
        save_classifier(
            model,
            path,
            arch=arch,
            args=args,
            classes=list(classes),
            mean=list(mean),
            std=list(std),
            config=to_dict(cfg),
            crop_pct=cfg.data.crop_pct,
            state=state,
        )
        accelerator.print(f"done: classifier in {path}, metrics in {out / 'metrics.jsonl'}")
    accelerator.end_training()
    return out


class FeatureSamples(torch.utils.data.Dataset):
    """Cached features as a dataset keyed like the image ones ((epoch, index) or index)."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        return {"image": self.features[index], "label": int(self.labels[index]), "index": index}


def _cached(accelerator, encoder, loader, cache: Path | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of a loader, computed once (and kept on disk, memory-mapped, when `cache` is set)."""
    if cache is not None and (cache / f"{name}_features.npy").exists():
        feats = np.load(cache / f"{name}_features.npy", mmap_mode="r")
        return torch.from_numpy(np.asarray(feats)), torch.from_numpy(np.load(cache / f"{name}_labels.npy"))
    feats, labels = predict(encoder, prepare_eval(accelerator, loader), accelerator)
    if cache is not None and accelerator.is_main_process:
        cache.mkdir(parents=True, exist_ok=True)
        np.save(cache / f"{name}_features.npy", feats.numpy())
        np.save(cache / f"{name}_labels.npy", labels.numpy())
    return feats, labels


def probe_optimizer_name(optim: Any, eff_batch: int, accelerator: Any) -> str:
    """--optim.optimizer, with auto resolved by the effective batch (LARS needs large ones)."""
    if optim.optimizer == "auto":
        return "lars" if eff_batch >= LARS_MIN_BATCH else "sgd"
    if optim.optimizer == "lars" and eff_batch < LARS_MIN_BATCH:
        warn(
            accelerator,
            f"--optim.optimizer lars at an effective batch of {eff_batch}: LARS's trust ratio makes tiny steps "
            f"below {LARS_MIN_BATCH} (batch 16: 41.7% top-1 against 94.4% with SGD on the same features); "
            "use --optim.optimizer auto or sgd",
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


def run_linprobe(cfg: LinprobeConfig) -> Path:
    """Train BN + linear on frozen features; the encoder never changes (it stays in eval mode)."""
    setup = begin(cfg)
    source, train_src, val_src, classes = setup.source, setup.train_src, setup.val_src, setup.classes
    size, mean, std, accelerator = setup.size, setup.mean, setup.std, setup.accelerator
    encoder, arch, args = build_classifier(
        source, 0, img_size=cfg.model.img_size, global_pool=cfg.model.pool, fc_norm=False
    )
    encoder.requires_grad_(False).eval().to(accelerator.device)
    configure_speed(encoder, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    head = probe_head(encoder.num_features, len(classes))
    mode = cfg.mode if cfg.mode != "auto" else ("augmented" if cfg.augment else "cached")
    if mode == "cached" and cfg.augment:
        raise ConfigError("--mode cached: cached features cannot be augmented; use --mode augmented or --augment false")
    c = setup.in_chans
    eval_tf = eval_transform(size, cfg, mean, std, c)
    if mode == "cached":
        cache = Path(cfg.cache_dir) if cfg.cache_dir else None
        train_feats = _cached(accelerator, encoder, eval_loader(train_src, eval_tf, cfg, size, c), cache, "train")
        val_feats = _cached(accelerator, encoder, eval_loader(val_src, eval_tf, cfg, size, c), cache, "val")
        train_ds, val_ds, model, workers = FeatureSamples(*train_feats), FeatureSamples(*val_feats), head, 0
    else:
        train_tf = train_transform(size, scale=(0.08, 1.0), mean=mean, std=std, in_chans=c) if cfg.augment else eval_tf
        side = decode_side(size, math.sqrt(0.08 * 3 / 4)) if cfg.augment else decode_side(size, cfg.data.crop_pct)
        train_ds = LabeledSamples(train_src, train_tf, seed=cfg.seed, decode_side=side, in_chans=c)
        val_ds = LabeledSamples(val_src, eval_tf, decode_side=decode_side(size, cfg.data.crop_pct), in_chans=c)
        model, workers = LinearProbe(encoder, head), cfg.data.num_workers
    val_loader = make_loader(
        val_ds, batch_size=cfg.loop.batch_size, drop_last=False, collate_fn=collate_labeled, num_workers=workers
    )
    _, eff_batch = effective_lr(cfg, accelerator)
    opt_name = probe_optimizer_name(cfg.optim, eff_batch, accelerator)
    model, _ = launch(
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
        what=(
            f"linear probe of a {describe_vit(args)} ({mode}, pool {cfg.model.pool}, {opt_name}) on "
            f"{len(train_ds)} images, {len(classes)} classes"
        ),
        resume_from=setup.resume_from,
        val_loader=val_loader,
    )
    classifier, arch, args = build_classifier(
        source, len(classes), img_size=cfg.model.img_size, global_pool=cfg.model.pool, fc_norm=False
    )
    classifier.head = fold_probe_head(plain_model(accelerator, model) if mode == "cached" else head)
    return _finish(accelerator, cfg, classifier, arch, args, classes, mean, std)


def run_finetune(cfg: FinetuneConfig) -> Path:
    """Train the whole ViT with a fresh head: layer-wise lr decay, drop path, RandAugment, mixup/cutmix."""
    setup = begin(cfg)
    source, train_src, val_src, classes = setup.source, setup.train_src, setup.val_src, setup.classes
    size, mean, std, accelerator = setup.size, setup.mean, setup.std, setup.accelerator
    model, arch, args = build_classifier(
        source,
        len(classes),
        img_size=cfg.model.img_size,
        global_pool=cfg.model.pool,
        drop_path_rate=cfg.model.drop_path,
    )
    torch.nn.init.trunc_normal_(model.head.weight, std=2e-5)
    depth = len(model.blocks)
    if cfg.model.frozen_blocks > depth:
        raise ConfigError(
            f"--model.frozen_blocks {cfg.model.frozen_blocks}: the encoder has {depth} blocks; choose 0 to {depth}"
        )
    freeze_first_blocks(model, cfg.model.frozen_blocks)
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if cfg.model.frozen_blocks and fsdp is not None and fsdp.fsdp_version == 1 and not fsdp.use_orig_params:
        raise ConfigError(  # FSDP1 flattens each unit's parameters into one, which must all train or all not
            f"--model.frozen_blocks {cfg.model.frozen_blocks} under FSDP version 1 needs fsdp_use_orig_params: true "
            "in the Accelerate config (or fsdp_version: 2); or set --model.frozen_blocks 0"
        )
    a = cfg.aug
    train_tf = train_transform(
        size,
        scale=a.crop_scale,
        mean=mean,
        std=std,
        auto_augment=a.auto_augment,
        re_prob=a.reprob,
        in_chans=setup.in_chans,
    )
    side = decode_side(size, math.sqrt(a.crop_scale[0] * 3 / 4))
    train_ds = LabeledSamples(train_src, train_tf, seed=cfg.seed, decode_side=side, in_chans=setup.in_chans)
    val_loader = eval_loader(val_src, eval_transform(size, cfg, mean, std, setup.in_chans), cfg, size, setup.in_chans)
    mixup, criterion = mixup_and_criterion(cfg, len(classes))

    def task(m: torch.nn.Module, val: Any) -> ClassifierTask:
        ema = None
        if cfg.model.ema_decay:
            from timm.utils import ModelEmaV3

            ema = ModelEmaV3(plain_model(accelerator, m), decay=cfg.model.ema_decay)
            accelerator.register_for_checkpointing(ema)
        return ClassifierTask(m, accelerator=accelerator, criterion=criterion, val_loader=val, mixup=mixup, ema=ema)

    o = cfg.optim
    model, task = launch(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=train_ds,
        collate_fn=collate_labeled,
        num_workers=cfg.data.num_workers,
        optimizer=lambda m, lr: adamw(
            m, lr=lr, weight_decay=o.weight_decay, betas=tuple(o.betas), layer_decay=o.layer_decay
        ),
        task=task,
        what=f"fine-tuning a {describe_vit(args)} on {len(train_ds)} images, {len(classes)} classes",
        resume_from=setup.resume_from,
        val_loader=val_loader,
    )
    ema = task.ema
    if ema is not None:
        return _finish(accelerator, cfg, ema.module, arch, args, classes, mean, std)
    state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
    return _finish(accelerator, cfg, plain_model(accelerator, model), arch, args, classes, mean, std, state)


def mixup_and_criterion(cfg: FinetuneConfig, num_classes: int) -> tuple[Any, torch.nn.Module]:
    """timm's Mixup (None when off) and the loss that fits its targets."""
    a = cfg.aug
    if (a.mixup > 0 or a.cutmix > 0) and cfg.loop.batch_size % 2:
        raise ConfigError(
            f"--loop.batch_size {cfg.loop.batch_size}: mixup and cutmix pair the samples of a batch, so it must be "
            "even; choose an even batch size or set --aug.mixup 0 --aug.cutmix 0"
        )
    if a.mixup > 0 or a.cutmix > 0:
        mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, label_smoothing=a.smoothing, num_classes=num_classes)
        return mixup, SoftTargetCrossEntropy()
    if a.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(a.smoothing)
    return None, torch.nn.CrossEntropyLoss()


def run_knn(cfg: KnnConfig) -> dict[str, float]:
    """Weighted k-NN on frozen features: the validation set votes among the training set."""
    setup = begin(cfg)
    source, train_src, val_src = setup.source, setup.train_src, setup.val_src
    size, mean, std, accelerator = setup.size, setup.mean, setup.std, setup.accelerator
    encoder, _, _ = build_classifier(source, 0, img_size=cfg.model.img_size, global_pool=cfg.model.pool, fc_norm=False)
    encoder.to(accelerator.device)
    configure_speed(encoder, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    encoder = maybe_compile(encoder, cfg.loop.compile, accelerator.device.type)
    c = setup.in_chans
    tf = eval_transform(size, cfg, mean, std, c)
    bank, bank_labels = predict(
        encoder, prepare_eval(accelerator, eval_loader(train_src, tf, cfg, size, c)), accelerator
    )
    query, labels = predict(encoder, prepare_eval(accelerator, eval_loader(val_src, tf, cfg, size, c)), accelerator)
    scores = knn_scores(
        bank, bank_labels, query, num_classes=len(train_src.classes), k=cfg.k, temperature=cfg.temperature
    )
    probs = scores / scores.sum(1, keepdim=True).clamp_min(1e-12)
    nll = -probs.gather(1, labels[:, None]).clamp_min(1e-12).log().mean().item()
    result = {
        "step": 0,
        "epoch": 0,
        "eval": "knn",
        "loss": nll,
        **topk_accuracy(scores, labels),
        "k": cfg.k,
        "samples": len(labels),
    }
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        (out / METRICS).unlink(missing_ok=True)
    MetricsWriter(accelerator, out).write(result)
    accelerator.print(
        f"k-NN (k={cfg.k}, T={cfg.temperature}): top1 {result['top1']:.2f}%"
        + (f", top5 {result['top5']:.2f}%" if "top5" in result else "")
        + f" on {len(labels)} images"
    )
    # As the other stages end: the process group goes down here, not in the interpreter's exit, where a
    # 2-process run once aborted ("terminate called without an active exception").
    accelerator.end_training()
    return result
