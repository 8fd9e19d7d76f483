"""Wiring: a validated config in, a trained run out. Each stage is a few dozen lines over `fit`."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.optim import create_optimizer_v2

from mae.config import ConfigError, PretrainConfig, flatten, to_dict
from mae.data.samplers import EpochSampler
from mae.data.sources import open_source
from mae.data.transforms import PretrainSamples, collate_samples
from mae.export import save_encoder
from mae.importers import load_pretrained
from mae.models.registry import create_mae, preset_config, resolve_preset
from mae.train.checkpoint import list_checkpoints, load_loop_state
from mae.train.loop import LoopState, Schedule, fit
from mae.train.metrics import MetricsWriter
from mae.train.tasks import PretrainTask

PREVIEW_IMAGES = 8


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: where CPU autocast to bf16 pays (elsewhere it is emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_bf16() else "no"


def _multi_process_cpu() -> bool:
    """torchrun / accelerate launch without GPUs: Accelerate needs cpu=True to use gloo."""
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def resolve_tracker(choice: str) -> str | None:
    if choice == "auto":
        found = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        return "tensorboard" if found else None
    return None if choice == "none" else choice


def model_kwargs(cfg: PretrainConfig) -> dict:
    m = cfg.model
    kwargs = {"img_size": m.img_size, "mask_ratio": m.mask_ratio, "norm_pix_loss": m.norm_pix_loss}
    if m.patch_size is not None:
        kwargs["patch_size"] = m.patch_size
    return kwargs


def validate_pretrain(cfg: PretrainConfig) -> None:
    """Every option checked before any work starts; ConfigError names option, value and range."""
    try:
        resolve_preset(cfg.model.name)
    except ValueError as e:
        raise ConfigError(f"--model.name: {e}") from None
    size = cfg.model.img_size
    hw = (size, size) if isinstance(size, int) else tuple(size)
    patch = cfg.model.patch_size or preset_config(cfg.model.name)["patch_size"]
    if patch < 1 or any(s < 1 or s % patch for s in hw):
        raise ConfigError(f"--model.img_size {size}: must be a positive multiple of the patch size {patch}")
    checks = [
        ("model.mask_ratio", cfg.model.mask_ratio, 0.0 <= cfg.model.mask_ratio < 1.0, "in [0, 1)"),
        ("loop.epochs", cfg.loop.epochs, cfg.loop.epochs >= 1, ">= 1"),
        ("loop.batch_size", cfg.loop.batch_size, cfg.loop.batch_size >= 1, ">= 1"),
        ("loop.accum_steps", cfg.loop.accum_steps, cfg.loop.accum_steps >= 1, ">= 1"),
        ("loop.log_every", cfg.loop.log_every, cfg.loop.log_every >= 1, ">= 1"),
        ("loop.checkpoint_every", cfg.loop.checkpoint_every, cfg.loop.checkpoint_every >= 1, ">= 1"),
        ("loop.keep_checkpoints", cfg.loop.keep_checkpoints, cfg.loop.keep_checkpoints >= 1, ">= 1"),
        ("data.num_workers", cfg.data.num_workers, cfg.data.num_workers >= 0, ">= 0"),
        ("optim.blr", cfg.optim.blr, cfg.optim.blr > 0, "> 0"),
        ("optim.weight_decay", cfg.optim.weight_decay, cfg.optim.weight_decay >= 0, ">= 0"),
        ("optim.warmup_epochs", cfg.optim.warmup_epochs, cfg.optim.warmup_epochs >= 0, ">= 0"),
        (
            "data.crop_scale",
            cfg.data.crop_scale,
            0 < cfg.data.crop_scale[0] <= cfg.data.crop_scale[1] <= 1,
            "0 < min <= max <= 1",
        ),
    ]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"--{name} {value}: must be {allowed}")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise ConfigError(f"--resume {cfg.resume}: no such checkpoint; use auto, never or a checkpoint folder")
    out = Path(cfg.output_dir)
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"--output_dir {cfg.output_dir}: not writable; choose a folder you can write to")


def find_resume_checkpoint(cfg: PretrainConfig) -> Path | None:
    """The checkpoint to continue from, after checking it ran the same config."""
    if cfg.resume == "never":
        return None
    ckpt = list_checkpoints(cfg.output_dir)[-1:] if cfg.resume == "auto" else [Path(cfg.resume)]
    if not ckpt:
        return None
    ckpt = ckpt[0]
    saved = flatten(yaml.safe_load((ckpt / "config.yaml").read_text()))
    current = flatten(to_dict(cfg))
    ignore = {"loop.epochs", "resume", "output_dir"}
    changed = sorted(k for k in set(saved) | set(current) if k not in ignore and saved.get(k) != current.get(k))
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ConfigError(
            f"--resume {cfg.resume}: {ckpt} was trained with a different config ({diffs}); "
            "restore those options, or pass --resume never (or a new --output_dir) to start over"
        )
    return ckpt


def run_pretrain(cfg: PretrainConfig) -> Path:
    """Pretrain per `cfg`; returns the output folder."""
    validate_pretrain(cfg)
    output_dir = Path(cfg.output_dir)
    resume_from = find_resume_checkpoint(cfg)
    accelerator = Accelerator(
        mixed_precision=resolve_precision(cfg.loop.mixed_precision),
        gradient_accumulation_steps=cfg.loop.accum_steps,
        log_with=resolve_tracker(cfg.loop.log_with),
        project_dir=str(output_dir),
        cpu=_multi_process_cpu(),
    )
    set_seed(cfg.seed)
    model = create_mae(cfg.model.name, **model_kwargs(cfg))
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)

    source = open_source(cfg.data.path, cfg.data.image_column)
    samples = PretrainSamples(
        source,
        img_size=model.img_size,
        patch_size=model.patch_size,
        seed=cfg.seed,
        crop_scale=cfg.data.crop_scale,
        hflip=cfg.data.hflip,
    )
    sampler = EpochSampler(len(samples), cfg.seed)
    per_step = cfg.loop.batch_size * accelerator.num_processes
    if len(samples) < per_step:
        raise ConfigError(
            f"--loop.batch_size {cfg.loop.batch_size}: {len(samples)} images cannot fill one batch of "
            f"{cfg.loop.batch_size} x {accelerator.num_processes} processes; lower the batch size"
        )
    loader = torch.utils.data.DataLoader(
        samples,
        batch_size=cfg.loop.batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_samples,
        num_workers=cfg.data.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=cfg.data.num_workers > 0,  # the epoch travels with each index, not the dataset
    )

    eff_batch = cfg.loop.batch_size * cfg.loop.accum_steps * accelerator.num_processes
    lr = cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.blr * eff_batch / 256
    optimizer = create_optimizer_v2(
        model, "adamw", lr=lr, weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps_per_epoch = math.ceil(len(loader) / cfg.loop.accum_steps)
    schedule = Schedule(
        base_lr=lr,
        min_lr=cfg.optim.min_lr,
        total_steps=cfg.loop.epochs * steps_per_epoch,
        warmup_steps=round(cfg.optim.warmup_epochs * steps_per_epoch),
    )

    config_yaml = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    state = LoopState()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(config_yaml)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        state = LoopState(**load_loop_state(resume_from))
        accelerator.print(f"resuming from {resume_from} (step {state.step}, epoch {state.epoch})")
    elif accelerator.is_main_process and (output_dir / "metrics.jsonl").exists():
        (output_dir / "metrics.jsonl").unlink()  # a fresh start: the old run's log would mislead
    MetricsWriter(accelerator, output_dir).truncate_after(state.step)
    if accelerator.log_with:
        accelerator.init_trackers("mae", config=flatten(to_dict(cfg)))
    accelerator.print(
        f"pretraining {cfg.model.name} on {len(samples)} images ({cfg.data.path or 'demo photos'}): "
        f"effective batch {eff_batch}, lr {lr:.3g} (blr {cfg.optim.blr:g}), {steps_per_epoch} steps/epoch, "
        f"{schedule.total_steps} steps,"
        f" precision {accelerator.mixed_precision}, {accelerator.num_processes} process(es)"
    )
    preview = collate_samples([samples[(0, i)] for i in _preview_indices(source)])
    task = PretrainTask(
        model,
        accelerator=accelerator,
        mean=cfg.data.mean,
        std=cfg.data.std,
        preview_batch=preview if preview["image"] is not None else None,
        output_dir=output_dir,
    )
    fit(
        task,
        accelerator=accelerator,
        loader=loader,
        sampler=sampler,
        optimizer=optimizer,
        schedule=schedule,
        loop=cfg.loop,
        output_dir=output_dir,
        config_yaml=config_yaml,
        state=state,
        clip_grad=cfg.optim.clip_grad,
    )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path = save_encoder(accelerator.unwrap_model(model), output_dir / "encoder.safetensors", to_dict(cfg))
        accelerator.print(f"done: encoder weights in {path}, reconstructions in {output_dir / 'preview.png'}")
    accelerator.end_training()
    return output_dir


def _preview_indices(source) -> list[int]:
    """Distinct images spread over the source (the demo repeats its photos; take each once)."""
    distinct = len(getattr(source, "images", [])) or len(source)
    n = min(PREVIEW_IMAGES, distinct)
    return [round(i * (distinct - 1) / max(1, n - 1)) for i in range(n)] if n > 1 else [0]


def run_visualize(cfg) -> Path:
    """Reconstruct `cfg.images` with a pretrained model; writes one PNG grid."""
    from PIL import Image
    from torchvision.transforms.v2 import functional as F

    from mae.data.sources import to_rgb
    from mae.data.transforms import DECODE_ERRORS
    from mae.visualize import reconstruction_grid, save_grid

    model = load_pretrained(cfg.checkpoint)
    saved = (
        yaml.safe_load((Path(cfg.checkpoint) / "config.yaml").read_text())
        if (Path(cfg.checkpoint) / "config.yaml").exists()
        else {}
    )
    data = saved.get("data", {})
    mean, std = tuple(data.get("mean", PretrainConfig().data.mean)), tuple(data.get("std", PretrainConfig().data.std))
    images = []
    for file in cfg.images:
        try:
            with Image.open(file) as img:
                img = to_rgb(img)
        except (FileNotFoundError, *DECODE_ERRORS) as e:
            raise ConfigError(f"--images {file}: cannot read this image ({e})") from None
        short = min(model.img_size)
        img = F.center_crop(F.resize(img, short, interpolation=F.InterpolationMode.BICUBIC), list(model.img_size))
        images.append(F.pil_to_tensor(img))
    g = torch.Generator().manual_seed(cfg.seed)
    noise = torch.rand(len(images), model.num_patches, generator=g)
    if cfg.mask_ratio is not None:
        model.mask_ratio = cfg.mask_ratio
    grid, loss = reconstruction_grid(model, torch.stack(images), noise, mean, std)
    path = save_grid(grid, cfg.output)
    print(f"wrote {path} ({len(images)} images, loss {loss:.4f})")
    return path
