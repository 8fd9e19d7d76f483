"""`mae segment`: semantic segmentation from the encoder's patch tokens: a head (`--head linear`, the frozen-encoder
probe; `--head progressive`, a SETR-PUP decoder that fine-tunes the encoder with layer decay) trained on images and
per-pixel masks, evaluated each epoch (mIoU, pixel accuracy, per-class IoU) with a sliding window at each image's
own size; the segmenter goes to OUTPUT_DIR/segmenter.safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mae.config import ConfigError, SegmentConfig
from mae.data.open import recorded_path
from mae.data.segment_transforms import JointEvalTransform, JointTrainTransform
from mae.data.segmentation import SegmentationSamples, collate_segments, open_segmentation, split_segmentation
from mae.models.classifier import build_classifier, freeze_first_blocks
from mae.models.segmenter import HEADS, HeadKind, Segmenter
from mae.run_folder import CLASSES, LAST_METRICS, SEGMENTER, last_evaluation
from mae.stages.downstream import Downstream, open_downstream
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import close_accelerator, full_state_dict, plain_model
from mae.train.checkpoint import config_record
from mae.train.loaders import make_loader
from mae.train.optim import adamw
from mae.train.segment_task import SegmentTask
from mae.train.trainer import train
from mae.weights.segmenter import palette_of, save_segmenter


@register_stage("segment", SegmentConfig, "Train a segmentation head on the encoder's patch tokens (masks per pixel).")
def run_segment(cfg: SegmentConfig) -> StageResult:
    """Train the head (and, with a head that does, the encoder); write the segmenter and metrics.json."""
    kind = head_kind(cfg)
    if cfg.data.path is None or cfg.data.path == "":
        raise ConfigError(
            "--data.path: required: a folder with images/ and masks/ (same names), or a `datasets` "
            "dataset with an image and a mask column (see --help)"
        )
    setup = open_downstream(cfg, splits=segmentation_splits)
    model, arch, args = build_segmenter(setup, cfg, kind)
    train_tf = JointTrainTransform(setup.size, mean=setup.mean, std=setup.std, scale=cfg.aug.scale,
                                   hflip=cfg.aug.hflip)  # fmt: skip
    train_ds = SegmentationSamples(setup.train, train_tf, seed=cfg.seed, in_chans=setup.in_chans)
    o, accelerator, classes = cfg.optim, setup.accelerator, setup.classes
    model, task = train(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=train_ds,
        collate_fn=collate_segments,
        num_workers=cfg.data.num_workers,
        optimizer=lambda m, lr: adamw(
            m, lr=lr, weight_decay=o.weight_decay, betas=tuple(o.betas), layer_decay=o.layer_decay
        ),  # fmt: skip
        task=lambda m, _: SegmentTask(
            m, accelerator=accelerator, val_loader=eval_loader(setup, cfg), num_classes=len(classes)
        ),
        title=f"segmentation ({cfg.head} head) on {len(train_ds)} images, {len(classes)} classes",
        resume_from=setup.resume_from,
    )
    state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
    path = Path(cfg.output_dir) / SEGMENTER
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out = Path(cfg.output_dir)
        save_segmenter(
            plain_model(accelerator, model), path, arch=arch, args=args, head=cfg.head, classes=classes,
            palette=palette_of(setup.train.palette, len(classes)), mean=list(setup.mean), std=list(setup.std),
            record=setup.encoder.record, config=config_record(cfg), state=state,
        )  # fmt: skip
        (out / CLASSES).write_text(json.dumps(classes))
        last = task.last_evaluation or last_evaluation(out)  # a rerun of a finished run trains and evaluates nothing
        if last:
            (out / LAST_METRICS).write_text(json.dumps(last, indent=1) + "\n")
        accelerator.print(f"done: segmenter in {path}, metrics in {out / 'metrics.jsonl'}")
    close_accelerator(accelerator)
    return StageResult(Path(cfg.output_dir), task.last_evaluation, path)


def head_kind(cfg: SegmentConfig) -> HeadKind:
    """The registered head --head names; one line naming the choices otherwise."""
    try:
        return HEADS.get(cfg.head)
    except ConfigError as e:
        raise ConfigError(f"--head {cfg.head}: {e}") from None


def segmentation_splits(cfg: SegmentConfig) -> tuple[Any, Any]:
    """(train, validation) segmentation sources with the same classes."""
    d = cfg.data
    columns = {"image_column": d.image_column, "mask_column": d.mask_column}
    train_src = open_segmentation(d.path, num_classes=d.num_classes, option="--data.path", **columns)
    if not d.val_path:
        return split_segmentation(train_src, d.val_fraction, cfg.seed)
    val_src = open_segmentation(d.val_path, num_classes=len(train_src.classes), option="--data.val_path", **columns)
    if val_src.classes != train_src.classes and val_src.named:
        raise ConfigError(f"--data.val_path {recorded_path(d.val_path)}: its classes {val_src.classes[:5]}... differ "
                          f"from --data.path's {train_src.classes[:5]}...")  # fmt: skip
    val_src.classes = train_src.classes
    return train_src, val_src


def build_segmenter(setup: Downstream, cfg: SegmentConfig, kind: HeadKind) -> tuple[Segmenter, str, dict]:
    """The encoder (`build_classifier`'s timm ViT without a head, its final norm kept) under a fresh head."""
    encoder, arch, args = build_classifier(
        setup.encoder, 0, img_size=cfg.model.img_size, global_pool="avg", fc_norm=False,
        drop_path_rate=cfg.model.drop_path if kind.trains_encoder else 0.0,
    )  # fmt: skip
    frozen = cfg.model.frozen_blocks
    freeze_first_blocks(encoder, frozen)  # the depth's bound first, as before
    if frozen and not kind.trains_encoder:
        raise ConfigError(f"--model.frozen_blocks {frozen}: --head {cfg.head} keeps the whole encoder frozen; use "
                          "--head progressive to fine-tune it, or leave --model.frozen_blocks 0")  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # the head's init from --seed, whatever drew before
        torch.manual_seed(cfg.seed)
        head = kind.build(encoder.num_features, len(setup.classes), encoder.patch_embed.patch_size[0])
    return Segmenter(encoder, head, frozen_encoder=not kind.trains_encoder), arch, args


def eval_loader(setup: Downstream, cfg: SegmentConfig) -> torch.utils.data.DataLoader:
    """The validation images of this process (`share_loader`), through the evaluation transform."""
    dataset = SegmentationSamples(setup.val, JointEvalTransform(mean=setup.mean, std=setup.std),
                                  in_chans=setup.in_chans)  # fmt: skip
    acc = setup.accelerator
    return share_loader(dataset, acc.process_index, acc.num_processes, cfg.loop.batch_size, cfg.data.num_workers)


def share_loader(dataset: Any, rank: int, world: int, batch_size: int, num_workers: int = 0):
    """An ordered pass over process `rank`'s share of `dataset` (every `world`-th sample, each image at its own size):
    no sample repeated to even out the processes, so the summed confusion matrix is exactly one process's."""
    share = torch.utils.data.Subset(dataset, np.arange(rank, len(dataset), world).tolist())
    return make_loader(share, batch_size=batch_size, collate_fn=collate_segments, num_workers=num_workers,
                       drop_last=False, persistent=False)  # fmt: skip
