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
from mae.run_folder import read_metrics
from mae.stages.downstream import (
    Downstream,
    labeled_eval_loader,
    open_downstream,
    save_run_classifier,
)
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import full_state_dict, plain_model, warn
from mae.train.features import predict, topk_accuracy
from mae.train.loaders import prepare_eval
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
    preamble = (
        [fit_head_as_probe(model, cfg, setup)] if cfg.model.head_init == "probe" and not setup.resume_from else []
    )
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
        preamble=preamble,
    )
    if task.ema is not None:
        path = save_run_classifier(setup, cfg, task.ema.module, arch, args)
    else:
        state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
        path = save_run_classifier(setup, cfg, plain_model(accelerator, model), arch, args, state)
    _compare_with_probe(setup, Path(cfg.output_dir), task.last_evaluation)
    return StageResult(Path(cfg.output_dir), task.last_evaluation, path)


def freeze(model: torch.nn.Module, cfg: FinetuneConfig, setup: Downstream) -> None:
    """--model.frozen_blocks: the stem and the first N blocks stay as pretrained (checked against the depth and
    the FSDP setting that could not train them)."""
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


class _PreLogits(torch.nn.Module):
    """What a timm classifier's head sees: pooled (and fc_norm'ed) features."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_head(self.model.forward_features(x), pre_logits=True)


def fit_head_as_probe(model: torch.nn.Module, cfg: FinetuneConfig, setup: Downstream) -> dict:
    """LP-FT (Kumar et al. 2022): fit the head as a linear probe on the frozen features it will see (training images
    through the eval transform, computed once), so fine-tuning starts from a head that already separates the classes
    and the early gradients do not distort the pretrained features. Returns the probe's validation metrics line."""
    acc = setup.accelerator
    features = _PreLogits(model).to(acc.device)  # `predict` runs it in eval mode and restores the mode
    x, y = predict(features, prepare_eval(acc, labeled_eval_loader(setup, setup.train, cfg)), acc)
    vx, vy = predict(features, prepare_eval(acc, labeled_eval_loader(setup, setup.val, cfg)), acc)
    head = torch.nn.Linear(x.shape[1], len(setup.classes), device="meta").to_empty(device="cpu")  # no RNG drawn
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
    # Full-batch L-BFGS on the cached features: deterministic, the same on every process, seconds on a CPU.
    opt = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=PROBE_ITERATIONS, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), y) + PROBE_L2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        model.head.weight.copy_(head.weight), model.head.bias.copy_(head.bias)
        logits = head(vx)
    record = {"step": 0, "epoch": 0, "eval": "probe_init", "loss": torch.nn.functional.cross_entropy(logits, vy).item(),
              **topk_accuracy(logits, vy), "samples": len(vy)}  # fmt: skip
    acc.print(f"head from a linear probe (LP-FT): top1 {record['top1']:.2f}% on {len(vy)} validation images")
    return record


PROBE_ITERATIONS = 100  # L-BFGS iterations of the LP-FT probe
PROBE_L2 = 1e-4  # its L2 penalty on the head's weights (logistic regression's usual regulariser)


def _compare_with_probe(setup: Downstream, output_dir: Path, final: dict) -> None:
    """Say so when fine-tuning ended below the probe it started from (its line in metrics.jsonl, also on resume)."""
    if not setup.accelerator.is_main_process:
        return
    start = next((m for m in read_metrics(output_dir) if m.get("eval") == "probe_init"), None)
    if start and final.get("top1", 100.0) < start["top1"]:
        warn(
            setup.accelerator,
            f"fine-tuning ended at top1 {final['top1']:.2f}%, below the {start['top1']:.2f}% of the linear probe it "
            "started from: train longer (--loop.min_steps), lower --optim.blr, or freeze blocks "
            "(--model.frozen_blocks); the probe itself is what `mae linprobe` gives",
        )


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
