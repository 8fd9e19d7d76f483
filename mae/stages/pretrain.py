"""`mae pretrain`: masked-autoencoder pretraining of a ViT encoder, on folders, datasets, shards or streams."""

from __future__ import annotations

import hashlib
import sys
import warnings
from dataclasses import fields, replace
from pathlib import Path

import torch

from mae.config import DEMO_OVERRIDES, IMAGENET_MEAN, IMAGENET_STD, ConfigError, ModelConfig, PretrainConfig
from mae.data.open import open_source, recorded_path
from mae.data.stats import channel_stats
from mae.data.transforms import PretrainSamples, collate_samples, load_image
from mae.errors import CheckpointError
from mae.models.decoder import PixelDecoder, check_decoder
from mae.models.mae import MaskedAutoencoder
from mae.models.masking import mask_generator, num_visible
from mae.models.registry import create_mae, preset_config, resolve_preset
from mae.models.spec import ModelSpec
from mae.run_folder import ENCODER, PREVIEW, decoder_beside
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import close_accelerator, full_state_dict, open_accelerator, plain_model
from mae.train.checkpoint import check_output_dir, config_record, find_resume_checkpoint
from mae.train.features import KnnMonitor
from mae.train.optim import adamw
from mae.train.tasks import PretrainTask
from mae.train.trainer import train
from mae.weights.export import save_decoder, save_encoder
from mae.weights.importers import load_pretrained, locate_weights

PREVIEW_IMAGES = 8  # images in the reconstruction previews


# The model options that are `ModelSpec` fields of the same name (`name` is the preset, not the spec's arch).
_SPEC_OPTIONS = tuple(f.name for f in fields(ModelConfig) if f.name in {g.name for g in fields(ModelSpec)})


def model_kwargs(cfg: PretrainConfig) -> dict:
    """`create_mae` overrides from the model section (those not left to the preset) and the data's statistics."""
    kwargs = {k: getattr(cfg.model, k) for k in _SPEC_OPTIONS if getattr(cfg.model, k) is not None}
    mean, std = cfg.data.mean, cfg.data.std
    return kwargs | ({"mean": tuple(mean), "std": tuple(std)} if "auto" not in (mean, std) else {})


def start_model(cfg: PretrainConfig) -> tuple[PretrainConfig, MaskedAutoencoder | None]:
    """With --init: its weights as the MAE to train, and `cfg` stating the architecture they fix (its model
    section) and their sha256 (so a rerun resumes only on the same weights). Without: (cfg, None)."""
    if not cfg.init:
        return cfg, None
    try:
        path, _ = locate_weights(cfg.init)
        digest = _sha256(path)
        if cfg.init_sha256 and cfg.init_sha256 != digest:
            raise ConfigError(
                f"--init_sha256 {cfg.init_sha256}: {path} now has sha256 {digest}: the weights changed since the "
                "run started; restore them, or start a new run (another --output_dir, or --resume never)"
            )
        m, default = cfg.model, ModelConfig()  # the options set away from their defaults override the file's
        overrides = {k: v for k in _SPEC_OPTIONS if (v := getattr(m, k)) is not None and v != getattr(default, k)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load_pretrained(cfg.init, **overrides)
    except CheckpointError as e:
        raise ConfigError(f"--init {cfg.init}: {e}") from None
    for w in caught:  # e.g. an encoder-only file's fresh decoder, a classifier's dropped head
        print(f"mae pretrain: warning: --init: {w.message}", file=sys.stderr)
    return replace(cfg, init_sha256=digest, model=replace(cfg.model, **_architecture(model))), model


def _architecture(model: MaskedAutoencoder) -> dict:
    """The model section's fields that rebuild `model` (`create_mae(name, **model_kwargs(cfg))`): its record's."""
    spec = model.spec
    h, w = spec.img_size
    facts = {k: getattr(spec, k) for k in _SPEC_OPTIONS}
    return facts | {"name": spec.encoder_arch, "img_size": h if h == w else [h, w]}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
    try:
        check_decoder(cfg.model.decoder, predict_ratio=cfg.model.predict_ratio)
    except ValueError as e:
        raise ConfigError(f"--model.decoder {cfg.model.decoder}: {e}") from None
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


@register_stage("pretrain", PretrainConfig, "Pretrain a ViT encoder by masked autoencoding.", demo=DEMO_OVERRIDES)
def run_pretrain(cfg: PretrainConfig) -> StageResult:
    """Pretrain per `cfg`: the encoder goes to OUTPUT_DIR/encoder.safetensors."""
    cfg, model = start_model(cfg)
    validate_pretrain(cfg)
    source, first = open_pretraining_data(cfg)
    cfg = resolve_data_stats(cfg, first)
    output_dir = Path(cfg.output_dir)
    resume_from = find_resume_checkpoint(cfg)
    accelerator = open_accelerator(cfg)
    model = model or create_mae(cfg.model.name, **model_kwargs(cfg))
    model.record_stats(tuple(cfg.data.mean), tuple(cfg.data.std))  # --init: the file's model, this data's statistics
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
    preview = _preview(samples, first)
    model, task = train(
        cfg,
        accelerator=accelerator,
        model=model,
        dataset=samples,
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
        title=_title(cfg, model, len(samples)),
        resume_from=resume_from,
        spec=model.spec,
    )
    state = full_state_dict(accelerator, model)  # every process: sharded weights are gathered here
    path = output_dir / ENCODER
    if accelerator.is_main_process:
        save_encoder(plain_model(accelerator, model), path, config_record(cfg), full_state=state)
        if cfg.export_decoder:
            save_decoder(plain_model(accelerator, model), decoder_beside(path), full_state=state)
        accelerator.print(f"done: encoder weights in {path}, reconstructions in {output_dir / PREVIEW}")
    close_accelerator(accelerator)
    return StageResult(output_dir, task.last_evaluation, path)


def open_pretraining_data(cfg: PretrainConfig):
    """(the training source, a random-access source of its first images): the same for map-style data; a
    stream's first examples give the statistics and previews."""
    source = open_source(cfg.data.path, streaming=cfg.data.streaming, image_column=cfg.data.image_column)
    return source, source.first_examples(1000) if cfg.data.streaming else source


def _title(cfg: PretrainConfig, model, images: int) -> str:
    """The start line's head: what is pretrained, on what."""
    spec = model.spec
    size = f" {spec.decoder_embed_dim} x {spec.decoder_depth}" if isinstance(model.decoder, PixelDecoder) else ""
    start = f"--init {Path(cfg.init).name}" if cfg.init else cfg.model.name
    arch = f"{start}: {model.adapter.describe()}, {cfg.model.decoder} decoder{size}, {cfg.model.masking} masking"
    where = f"{recorded_path(cfg.data.path) or 'demo photos'}{', streamed' if cfg.data.streaming else ''}"
    return f"pretraining {arch} on {images} images ({where})"


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
