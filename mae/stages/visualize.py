"""`mae visualize`: reconstructions of a pretraining run, or the cls token's attention of an encoder, as a PNG grid."""

from __future__ import annotations

from pathlib import Path

import torch

from mae.config import ConfigError, VisualizeConfig
from mae.models.masking import mask_generator, num_visible
from mae.models.spec import ModelSpec
from mae.run_folder import run_config
from mae.stages.pretrain import check_masking
from mae.stages.registry import StageResult, register_stage
from mae.weights.importers import load_noting_decoder

PREVIEW_IMAGES = 8  # a folder given to --images shows its first images


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


@register_stage(
    "visualize",
    VisualizeConfig,
    "Write original | masked | reconstruction grids for some images.",
    lists={"images": "Image files, or folders (their first 8 images)."},
    flags={"attention": "Show attention maps."},
)
def run_visualize(cfg: VisualizeConfig) -> StageResult:
    """Reconstructions (--checkpoint) or cls attention maps (--attention --pretrained); one PNG grid."""
    from mae.figures import attention_grid, reconstruction_grid, save_grid
    from mae.weights.importers import CheckpointError

    if cfg.attention:
        from mae.models.classifier import build_classifier
        from mae.weights.importers import read_encoder

        if not (cfg.pretrained or cfg.checkpoint):
            raise ConfigError(
                "--pretrained: required with --attention (an encoder export, output folder or checkpoint)"
            )
        try:
            spec = read_encoder(cfg.pretrained or cfg.checkpoint)
        except (CheckpointError, FileNotFoundError) as e:
            raise ConfigError(f"--pretrained {cfg.pretrained or cfg.checkpoint}: {e}") from None
        mean, std = _stats(spec.record, cfg.pretrained or cfg.checkpoint)
        vit, _, _ = build_classifier(spec, 0)
        try:
            images = _read_images(cfg.images, spec.img_size, spec.in_chans)
            grid = attention_grid(vit, images, mean, std)
        except ValueError as e:  # e.g. an encoder without a class token
            raise ConfigError(f"--pretrained {cfg.pretrained or cfg.checkpoint}: {e}") from None
        path = save_grid(grid, cfg.output)
        print(f"wrote {path} (cls attention of the last block, {len(cfg.images)} images)")
        return StageResult(export=path)
    if not cfg.checkpoint:
        raise ConfigError("--checkpoint: required (a pretraining output folder or a checkpoint with a decoder)")
    model, has_decoder = load_noting_decoder(cfg.checkpoint)
    if not has_decoder:  # a freshly initialised decoder's reconstructions are noise
        raise ConfigError(
            f"--checkpoint {cfg.checkpoint} holds an encoder only, and reconstructions need its trained decoder: give "
            "a pretraining run folder or an export written with --with_decoder, or show --attention (the encoder alone)"
        )
    run = run_config(cfg.checkpoint) or {}
    data = run.get("data", {})
    mean, std = _stats(model.spec, cfg.checkpoint)
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
    return StageResult(export=path, metrics={"loss": loss})


def _stats(spec: ModelSpec | None, source: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalisation the model was trained with, by the model record's rule; one line when it is unknown."""
    stats = spec.input_stats() if spec is not None else None
    if stats is None:
        raise ConfigError(f"{source}: records no normalisation for its channels; pretrain with --data.mean/std")
    return stats
