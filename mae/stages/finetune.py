"""`mae finetune`: the whole ViT trained with a fresh head (the paper's recipe: layer-wise lr decay, drop path,
RandAugment, mixup/cutmix, label smoothing), optionally with its first blocks frozen and an EMA of the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from mae.config import ConfigError, FinetuneConfig
from mae.data.labeled import LabeledSamples
from mae.data.transforms import collate_labeled, crop_decode_side, train_transform
from mae.models.classifier import build_classifier, freeze_first_blocks
from mae.models.encoder import encoder_adapter
from mae.stages.downstream import (
    Downstream,
    labeled_eval_loader,
    open_downstream,
    save_run_classifier,
)
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import full_state_dict, plain_model
from mae.train.optim import adamw
from mae.train.tasks import ClassifierTask
from mae.train.trainer import train


@register_stage("finetune", FinetuneConfig, "Fine-tune the whole ViT with a fresh classifier head.")
def run_finetune(cfg: FinetuneConfig) -> StageResult:
    """Train the whole ViT with a fresh head; the classifier goes to OUTPUT_DIR/classifier.safetensors."""
    setup = open_downstream(cfg)
    model, arch, args = build_classifier(
        setup.encoder,
        len(setup.classes),
        img_size=cfg.model.img_size,
        global_pool=cfg.model.pool,
        drop_path_rate=cfg.model.drop_path,
    )
    torch.nn.init.trunc_normal_(model.head.weight, std=2e-5)
    freeze(model, cfg, setup)
    a = cfg.aug
    train_tf = train_transform(
        setup.size, scale=a.crop_scale, mean=setup.mean, std=setup.std, auto_augment=a.auto_augment,
        re_prob=a.reprob, in_chans=setup.in_chans,
    )  # fmt: skip
    side = crop_decode_side(setup.size, a.crop_scale[0])
    train_ds = LabeledSamples(setup.train, train_tf, seed=cfg.seed, decode_side=side, in_chans=setup.in_chans)
    mixup, criterion = mixup_and_criterion(cfg, len(setup.classes))
    o, accelerator = cfg.optim, setup.accelerator
    if mixup is not None:
        accelerator.register_for_checkpointing(mixup)  # before `train` restores a checkpoint into it
    model, task = train(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=train_ds,
        collate_fn=collate_labeled,
        num_workers=cfg.data.num_workers,
        optimizer=lambda m, lr: adamw(
            m, lr=lr, weight_decay=o.weight_decay, betas=tuple(o.betas), layer_decay=o.layer_decay
        ),  # fmt: skip
        task=lambda m, val: ClassifierTask(
            m, accelerator=accelerator, criterion=criterion, val_loader=val, mixup=mixup, ema=ema(cfg, setup, m)
        ),
        title=f"fine-tuning a {encoder_adapter(model).describe()} on {len(train_ds)} images, "
        f"{len(setup.classes)} classes",
        resume_from=setup.resume_from,
        val_loader=labeled_eval_loader(setup, setup.val, cfg),
    )
    if task.ema is not None:
        path = save_run_classifier(setup, cfg, task.ema.module, arch, args)
    else:
        state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
        path = save_run_classifier(setup, cfg, plain_model(accelerator, model), arch, args, state)
    return StageResult(Path(cfg.output_dir), task.last_evaluation, path)


def freeze(model: torch.nn.Module, cfg: FinetuneConfig, setup: Downstream) -> None:
    """--model.frozen_blocks: the stem and the first N blocks stay as pretrained (checked against the depth and
    the FSDP setting that could not train them)."""
    depth = len(model.blocks)
    if cfg.model.frozen_blocks > depth:
        raise ConfigError(
            f"--model.frozen_blocks {cfg.model.frozen_blocks}: the encoder has {depth} blocks; choose 0 to {depth}"
        )
    freeze_first_blocks(model, cfg.model.frozen_blocks)
    fsdp = getattr(setup.accelerator.state, "fsdp_plugin", None)
    if cfg.model.frozen_blocks and fsdp is not None and fsdp.fsdp_version == 1 and not fsdp.use_orig_params:
        raise ConfigError(  # FSDP1 flattens each unit's parameters into one, which must all train or all not
            f"--model.frozen_blocks {cfg.model.frozen_blocks} under FSDP version 1 needs fsdp_use_orig_params: true "
            "in the Accelerate config (or fsdp_version: 2); or set --model.frozen_blocks 0"
        )


def ema(cfg: FinetuneConfig, setup: Downstream, model: torch.nn.Module):
    """timm's EMA of the (prepared) model's weights, checkpointed with the run; None without --model.ema_decay."""
    if not cfg.model.ema_decay:
        return None
    from timm.utils import ModelEmaV3

    average = ModelEmaV3(plain_model(setup.accelerator, model), decay=cfg.model.ema_decay)
    setup.accelerator.register_for_checkpointing(average)
    return average


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
        return OwnStreamMixup(mixup, cfg.seed), SoftTargetCrossEntropy()
    if a.smoothing > 0:
        return None, LabelSmoothingCrossEntropy(a.smoothing)
    return None, torch.nn.CrossEntropyLoss()


class OwnStreamMixup:
    """timm's `Mixup` drawing from a NumPy stream of its own, seeded by --seed and saved in every checkpoint
    (`state_dict`), instead of NumPy's global one. The global stream is also drawn by the loader when it
    prepares a batch in the training process (`seeded_rng`), and the batch after a checkpoint is prepared
    before the checkpoint and again after a resume: mixup's draws would then differ from an uninterrupted run's."""

    def __init__(self, mixup: Mixup, seed: int) -> None:
        self.mixup = mixup
        self.rng = np.random.RandomState(seed)

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outer = np.random.get_state()
        np.random.set_state(self.rng.get_state())
        try:
            return self.mixup(x, target)
        finally:
            self.rng.set_state(np.random.get_state())
            np.random.set_state(outer)

    def state_dict(self) -> dict[str, Any]:
        return {"numpy": self.rng.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.set_state(state["numpy"])
