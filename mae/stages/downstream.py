"""What the downstream stages (linear probe, fine-tuning, k-NN) share: the pretrained encoder, the labeled
splits, the input size and normalisation, resume and the Accelerator (`open_downstream`), their evaluation
loaders, and the classifier they write (`save_run_classifier`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from mae.config import ConfigError
from mae.data.labeled import LabeledSamples, split
from mae.data.open import open_source
from mae.data.transforms import collate_labeled, decode_side
from mae.data.transforms import eval_transform as labeled_eval_transform
from mae.models.encoder import EncoderSpec
from mae.run_folder import CLASSES, CLASSIFIER
from mae.train.accelerator import close_accelerator, open_accelerator
from mae.train.checkpoint import check_output_dir, config_record, find_resume_checkpoint
from mae.train.loaders import eval_loader
from mae.weights.classifier import save_classifier
from mae.weights.importers import CheckpointError, read_encoder


@dataclass(frozen=True)
class Downstream:
    """What every downstream stage starts from."""

    encoder: EncoderSpec  # the pretrained encoder (see `read_encoder`)
    train: Any  # labeled sources
    val: Any
    size: tuple[int, int]  # input size, and normalisation
    mean: tuple[float, ...]
    std: tuple[float, ...]
    in_chans: int
    resume_from: Path | None
    accelerator: Accelerator

    @property
    def classes(self) -> list[str]:
        return list(self.train.classes)


def open_downstream(cfg: Any, splits: Callable[[Any], tuple[Any, Any]] | None = None) -> Downstream:
    """Validate, open the encoder and the data (`splits(cfg)` -> (train, val); the labeled splits by default), find
    a checkpoint to resume, start Accelerate."""
    validate(cfg)
    try:
        encoder = read_encoder(cfg.pretrained, cfg.model.img_size, seed=cfg.seed)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"--pretrained {cfg.pretrained}: {e}") from None
    train_src, val_src = (splits or labeled_splits)(cfg)
    size = cfg.model.img_size or encoder.img_size
    if (cfg.data.mean or encoder.mean) is None or (cfg.data.std or encoder.std) is None:
        raise ConfigError(
            f"--data.mean / --data.std: {cfg.pretrained} records no normalisation for its {encoder.in_chans} "
            "channels; give them (e.g. from `mae stats`)"
        )
    return Downstream(
        encoder,
        train_src,
        val_src,
        (size, size) if isinstance(size, int) else tuple(size),
        tuple(cfg.data.mean or encoder.mean),
        tuple(cfg.data.std or encoder.std),
        encoder.in_chans,
        find_resume_checkpoint(cfg) if hasattr(cfg, "resume") else None,
        open_accelerator(cfg),
    )


def validate(cfg: Any) -> None:
    if not cfg.pretrained:
        raise ConfigError(
            "--pretrained: required: an encoder export, a pretraining output folder, a checkpoint "
            "(any format load_pretrained reads), or random:PRESET for a random-init baseline"
        )
    if not cfg.pretrained.startswith("random:") and not Path(cfg.pretrained).exists():
        raise ConfigError(f"--pretrained {cfg.pretrained}: no such file or folder")
    if not cfg.data.path:
        raise ConfigError("--data.path: required: a folder with one subfolder per class, or a labeled dataset")
    check_output_dir(cfg)


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
        streamed = d.streaming and str(d.val_path).startswith("hf:")  # a folder or shards beside a stream: map-style
        val_src = open_source(d.val_path, labeled=True, streaming=streamed, option="--data.val_path", **columns)
        if list(val_src.classes) != list(train_src.classes):
            raise ConfigError(
                f"--data.val_path {d.val_path}: its classes {val_src.classes[:5]}... differ from "
                f"--data.path's {train_src.classes[:5]}..."
            )
        return train_src, val_src
    return split(train_src, d.val_fraction, cfg.seed)


def eval_transform(setup: Downstream, cfg: Any):
    """The evaluation transform: resize to size / crop_pct, centre-crop, normalise."""
    return labeled_eval_transform(
        setup.size, crop_pct=cfg.data.crop_pct, mean=setup.mean, std=setup.std, in_chans=setup.in_chans
    )


def labeled_eval_loader(setup: Downstream, source: Any, cfg: Any, transform: Any = None):
    """An ordered pass over a labeled source (a stream's part on each process), for evaluation and features."""
    tf = transform or eval_transform(setup, cfg)
    return eval_loader(
        source,
        lambda src, **kw: LabeledSamples(src, tf, in_chans=setup.in_chans, **kw),
        collate_labeled,
        batch_size=cfg.loop.batch_size,
        num_workers=cfg.data.num_workers,
        decode_side=decode_side(setup.size, cfg.data.crop_pct),
    )


def save_run_classifier(
    setup: Downstream, cfg: Any, model: torch.nn.Module, arch: str, args: dict, state: dict | None = None
) -> Path:
    """Write classes.json and the classifier (its weights from `state`, a gathered full state dict, when given;
    else from `model`) on the main process; end the run. Returns the classifier's path."""
    accelerator, out = setup.accelerator, Path(cfg.output_dir)
    accelerator.wait_for_everyone()
    path = out / CLASSIFIER
    if accelerator.is_main_process:
        (out / CLASSES).write_text(json.dumps(setup.classes))
        save_classifier(
            model,
            path,
            arch=arch,
            args=args,
            classes=setup.classes,
            mean=list(setup.mean),
            std=list(setup.std),
            config=config_record(cfg),
            crop_pct=cfg.data.crop_pct,
            state=state,
            record=setup.encoder.record,
        )
        accelerator.print(f"done: classifier in {path}, metrics in {out / 'metrics.jsonl'}")
    close_accelerator(accelerator)
    return path
