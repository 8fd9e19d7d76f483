"""Wiring: a validated config in, a trained run out. Each stage is a few dozen lines over `fit`."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from mae.config import IMAGENET_MEAN, IMAGENET_STD, ConfigError, PretrainConfig, to_dict
from mae.data.open import open_source
from mae.data.stats import channel_stats
from mae.data.transforms import PretrainSamples, collate_samples, load_image
from mae.models.decoder import DECODERS
from mae.models.masking import mask_generator, num_visible
from mae.models.registry import create_mae, preset_config, resolve_preset
from mae.run_folder import ENCODER, PREVIEW, run_config
from mae.train.features import KnnMonitor
from mae.train.run import (
    adamw,
    check_output_dir,
    find_resume_checkpoint,
    full_state_dict,
    launch,
    open_accelerator,
    plain_model,
)
from mae.train.tasks import PretrainTask
from mae.weights.export import describe_vit, save_encoder, timm_architecture
from mae.weights.importers import load_pretrained

PREVIEW_IMAGES = 8


def model_kwargs(cfg: PretrainConfig) -> dict:
    m = cfg.model
    kwargs = {"img_size": m.img_size, "mask_ratio": m.mask_ratio, "norm_pix_loss": m.norm_pix_loss}
    kwargs["in_chans"] = m.in_chans
    kwargs.update(decoder=m.decoder, predict_ratio=m.predict_ratio)
    for name in (
        "patch_size",
        "embed_dim",
        "depth",
        "num_heads",
        "mlp_ratio",
        "decoder_embed_dim",
        "decoder_depth",
        "decoder_num_heads",
        "decoder_mlp_ratio",
    ):
        if getattr(m, name) is not None:
            kwargs[name] = getattr(m, name)
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
    arch = {**preset_config(cfg.model.name), **model_kwargs(cfg)}
    for width, heads in (("embed_dim", "num_heads"), ("decoder_embed_dim", "decoder_num_heads")):
        if arch[width] % 4 or arch[heads] < 1 or arch[width] % arch[heads]:
            raise ConfigError(
                f"--model.{width} {arch[width]} / --model.{heads} {arch[heads]}: the width must be a multiple of 4 "
                "and of the head count"
            )
    for width, ratio in (("embed_dim", "mlp_ratio"), ("decoder_embed_dim", "decoder_mlp_ratio")):
        if int(arch[width] * arch.get(ratio, 4.0)) < 1:
            raise ConfigError(
                f"--model.{ratio} {arch[ratio]}: leaves no MLP unit at width {arch[width]}; "
                f"use at least {1 / arch[width]:.3g}"
            )
    if cfg.model.decoder not in DECODERS:
        raise ConfigError(f"--model.decoder {cfg.model.decoder}: choose one of {', '.join(sorted(DECODERS))}")
    if cfg.model.decoder != "cross" and cfg.model.predict_ratio != 1:
        raise ConfigError(
            f"--model.predict_ratio {cfg.model.predict_ratio}: the mae decoder predicts every masked patch; "
            "use --model.decoder cross to predict a fraction of them"
        )
    check_masking(cfg.model.masking, (hw[0] // patch, hw[1] // patch), cfg.model.mask_ratio, "--model.masking")
    check_output_dir(cfg)


def check_masking(name: str, grid: tuple[int, int], mask_ratio: float, option: str) -> None:
    """The mask generator exists and accepts this grid and ratio (tried once, before any work)."""
    try:
        mask_generator(name)(grid, num_visible(grid[0] * grid[1], mask_ratio), torch.Generator().manual_seed(0))
    except ValueError as e:
        raise ConfigError(f"{option} {name}: {e}") from None


def resolve_data_stats(cfg: PretrainConfig, source) -> PretrainConfig:
    """`cfg` with --data.mean / --data.std `auto` (or left at ImageNet's beside another channel count than 3)
    measured on the data (seeded: a resumed run measures the same numbers), and one value per channel checked."""
    d, channels = cfg.data, cfg.model.in_chans
    if channels != 3:  # the defaults, ImageNet's RGB statistics, fit three channels only: measure the data's
        d = replace(
            d, mean="auto" if d.mean == IMAGENET_MEAN else d.mean, std="auto" if d.std == IMAGENET_STD else d.std
        )
    if "auto" in (d.mean, d.std):
        mean, std = channel_stats(source, channels, seed=cfg.seed)
        print(f"mae pretrain: channel statistics of the data: mean {mean}, std {std}", file=sys.stderr)
        d = replace(d, mean=tuple(mean) if d.mean == "auto" else d.mean, std=tuple(std) if d.std == "auto" else d.std)
        cfg = replace(cfg, data=d)
    for name, values in (("mean", d.mean), ("std", d.std)):
        if len(values) != channels:
            raise ConfigError(
                f"--data.{name} {list(values)}: {len(values)} values for --model.in_chans {channels}; give one per "
                "channel, or auto to measure them"
            )
    if d.preview_bands and max(d.preview_bands) >= channels:
        raise ConfigError(f"--data.preview_bands {list(d.preview_bands)}: the images have {channels} channel(s)")
    return cfg


def run_pretrain(cfg: PretrainConfig) -> Path:
    """Pretrain per `cfg`; returns the output folder."""
    validate_pretrain(cfg)
    source = open_source(cfg.data.path, streaming=cfg.data.streaming, image_column=cfg.data.image_column)
    if cfg.data.streaming:
        head = source.first_examples(1000)  # statistics and previews come from the stream's first examples
    else:
        head = source
    cfg = resolve_data_stats(cfg, head)
    output_dir = Path(cfg.output_dir)
    resume_from = find_resume_checkpoint(cfg)
    accelerator = open_accelerator(cfg)
    model = create_mae(cfg.model.name, **model_kwargs(cfg))
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    samples = PretrainSamples(
        source,
        img_size=model.img_size,
        patch_size=model.patch_size,
        seed=cfg.seed,
        crop_scale=cfg.data.crop_scale,
        hflip=cfg.data.hflip,
        masking=cfg.model.masking,
        mask_ratio=cfg.model.mask_ratio,
        in_chans=cfg.model.in_chans,
    )
    preview = _preview(samples, head)
    decoder = f"{cfg.model.decoder} decoder {model.decoder.embed.out_features} x {len(model.decoder.blocks)}"
    arch = f"{cfg.model.name}: {describe_vit(timm_architecture(model)[1])}, {decoder}, {cfg.model.masking} masking"
    model, _ = launch(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=samples,  # a stream's `launch` splits over processes
        collate_fn=collate_samples,
        num_workers=cfg.data.num_workers,
        optimizer=lambda m, lr: adamw(m, lr=lr, weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas)),
        task=lambda m, _: PretrainTask(
            m,
            accelerator=accelerator,
            mean=cfg.data.mean,
            std=cfg.data.std,
            preview_batch=preview if preview["image"] is not None else None,
            preview_bands=cfg.data.preview_bands,
            output_dir=output_dir,
            knn_monitor=knn_monitor(cfg, samples.img_size),
        ),
        what=f"pretraining {arch} on {len(samples)} images "
        f"({cfg.data.path or 'demo photos'}{', streamed' if cfg.data.streaming else ''})",
        resume_from=resume_from,
    )
    state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
    if accelerator.is_main_process:
        path = save_encoder(plain_model(accelerator, model), output_dir / ENCODER, to_dict(cfg), full_state=state)
        accelerator.print(f"done: encoder weights in {path}, reconstructions in {output_dir / PREVIEW}")
    accelerator.end_training()
    return output_dir


def knn_monitor(cfg: PretrainConfig, img_size: tuple[int, int]) -> KnnMonitor | None:
    """The --monitor.knn_data set, split and loaded once, evaluated at the model's input size."""
    m = cfg.monitor
    if not m.knn_data:
        return None
    from mae.data.labeled import LabeledSamples, split
    from mae.data.transforms import collate_labeled, eval_transform

    source = open_source(m.knn_data, labeled=True, option="--monitor.knn_data")
    bank, query = split(source, m.knn_val_fraction, cfg.seed)
    c = cfg.model.in_chans
    tf = eval_transform(img_size, crop_pct=1.0, mean=cfg.data.mean, std=cfg.data.std, in_chans=c)

    def loader(src):
        return torch.utils.data.DataLoader(
            LabeledSamples(src, tf, in_chans=c), batch_size=cfg.loop.batch_size, collate_fn=collate_labeled
        )

    return KnnMonitor(
        loader(bank), loader(query), num_classes=len(source.classes), k=m.knn_k, temperature=m.knn_temperature
    )


def _preview(samples: PretrainSamples, source) -> dict:
    """The preview batch: distinct images of `source` (a stream's first ones), prepared as in epoch 0."""
    items = []
    for i in _preview_indices(source):
        img, bad = load_image(source, i, samples.in_chans)
        items.append(bad if bad is not None else samples.prepare(img, 0, i))
    return collate_samples(items)


def _preview_indices(source) -> list[int]:
    """Distinct images spread over the source (the demo repeats its photos; take each once)."""
    distinct = len(getattr(source, "images", [])) or len(source)
    n = min(PREVIEW_IMAGES, distinct)
    return [round(i * (distinct - 1) / max(1, n - 1)) for i in range(n)] if n > 1 else [0]


def _read_images(files: list[str], size: tuple[int, int], in_chans: int = 3) -> torch.Tensor:
    """[N, C, H, W] (uint8 RGB for 3 channels, else float in [0, 1]): each image resized (short side) and
    centre-cropped to `size`, read as training reads it; a folder gives its first `PREVIEW_IMAGES` images."""
    from torchvision.transforms.v2 import functional as F

    from mae.data.images import DECODE_ERRORS, iter_image_files, read_array, read_rgb
    from mae.errors import ChannelError

    images = []
    listed = [sorted(iter_image_files(f))[:PREVIEW_IMAGES] if Path(f).is_dir() else [f] for f in files]
    for folder, group in zip(files, listed, strict=True):
        if not group:
            raise ConfigError(f"--images {folder}: a folder without images")
    for file in (f for group in listed for f in group):
        try:
            if in_chans == 3:
                img = read_rgb(file)
            else:
                img = torch.from_numpy(read_array(file)).permute(2, 0, 1)
        except ChannelError:  # an array (.npy, TIFF bands) of another channel count than the RGB model's
            img = torch.from_numpy(read_array(file)).permute(2, 0, 1)
        except (FileNotFoundError, *DECODE_ERRORS) as e:
            raise ConfigError(f"--images {file}: cannot read this image ({e})") from None
        if isinstance(img, torch.Tensor) and img.shape[0] != in_chans:
            raise ConfigError(f"--images {file}: {img.shape[0]} channel(s), but the model takes {in_chans}")
        img = F.center_crop(F.resize(img, min(size), interpolation=F.InterpolationMode.BICUBIC), list(size))
        images.append(img if isinstance(img, torch.Tensor) else F.pil_to_tensor(img))
    return torch.stack(images)


def run_visualize(cfg) -> Path:
    """Reconstructions (--checkpoint) or cls attention maps (--attention --pretrained); one PNG grid."""
    from mae.visualize import attention_grid, reconstruction_grid, save_grid
    from mae.weights.importers import CheckpointError

    if cfg.attention:
        from mae.weights.export import build_classifier, encoder_source

        if not (cfg.pretrained or cfg.checkpoint):
            raise ConfigError(
                "--pretrained: required with --attention (an encoder export, output folder or checkpoint)"
            )
        try:
            source = encoder_source(cfg.pretrained or cfg.checkpoint)
        except (CheckpointError, FileNotFoundError) as e:
            raise ConfigError(f"--pretrained {cfg.pretrained or cfg.checkpoint}: {e}") from None
        vit, _, _ = build_classifier(source, 0)
        size = tuple(source["args"]["img_size"])
        try:
            images = _read_images(cfg.images, size, source["args"].get("in_chans", 3))
            grid = attention_grid(vit, images, tuple(source["mean"]), tuple(source["std"]))
        except ValueError as e:  # e.g. an encoder without a class token
            raise ConfigError(f"--pretrained {cfg.pretrained or cfg.checkpoint}: {e}") from None
        path = save_grid(grid, cfg.output)
        print(f"wrote {path} (cls attention of the last block, {len(cfg.images)} images)")
        return path
    if not cfg.checkpoint:
        raise ConfigError("--checkpoint: required (a pretraining output folder or a checkpoint with a decoder)")
    model = load_pretrained(cfg.checkpoint)
    run = run_config(cfg.checkpoint) or {}
    data = run.get("data", {})
    mean, std = tuple(data.get("mean", PretrainConfig().data.mean)), tuple(data.get("std", PretrainConfig().data.std))
    images = _read_images(cfg.images, model.img_size, model.in_chans)
    if cfg.mask_ratio is not None:
        model.mask_ratio = cfg.mask_ratio
    masking = cfg.masking or run.get("model", {}).get("masking", "random")
    check_masking(masking, model.grid_size, model.mask_ratio, "--masking")
    g = torch.Generator().manual_seed(cfg.seed)
    keep = num_visible(model.num_patches, model.mask_ratio)
    noise = torch.stack([mask_generator(masking)(model.grid_size, keep, g) for _ in images])
    bands = cfg.bands or data.get("preview_bands")
    grid, loss = reconstruction_grid(model, images, noise, mean, std, bands)
    path = save_grid(grid, cfg.output)
    print(f"wrote {path} ({len(images)} images, loss {loss:.4f})")
    return path
