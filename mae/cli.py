"""`mae <stage> [--config RECIPE.yaml] [--section.key VALUE ...]`: parse, validate, dispatch.

Precedence: dataclass defaults < (demo settings, when no data is given) < YAML < command line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Any, Literal

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser

from mae.config import DEMO_OVERRIDES, ConfigError, FinetuneConfig, KnnConfig, LinprobeConfig, PretrainConfig
from mae.data.sources import DataError
from mae.importers import CheckpointError
from mae.train.loop import TrainingError


@dataclass(frozen=True)
class VisualizeConfig:
    images: list[str]
    """Image files to show."""
    checkpoint: str | None = None
    """Reconstructions: a pretraining output folder, or any checkpoint `load_pretrained` reads."""
    pretrained: str | None = None
    """Attention maps (with --attention): an encoder export, an output folder, or any checkpoint."""
    attention: bool = False
    """Show the cls token's attention over the patches in the last block, per head and averaged."""
    output: str = "reconstructions.png"
    """Where the PNG grid goes."""
    mask_ratio: float | None = None
    """Fraction of patches to mask; null = the model's."""
    seed: int = 0
    """Seeds the masks."""


@dataclass(frozen=True)
class ExportConfig:
    checkpoint: str
    """A pretraining output folder, a checkpoint, or any file `load_pretrained` reads."""
    output: str
    """The .safetensors file to write (or the folder, with --format hf-folder)."""
    format: Literal["safetensors", "hf-folder"] = "safetensors"
    """safetensors: one file; hf-folder: model.safetensors + timm config.json + model card."""


@dataclass(frozen=True)
class ConvertConfig:
    source: str
    """An official .pth, a transformers ViTMAE folder or file, a timm MAE encoder, or our own files."""
    output: str
    """The .safetensors file to write."""
    encoder_only: bool = False
    """Write only the encoder, as `mae export` does."""
    num_heads: int | None = None
    """Encoder head count, for widths that do not tell it."""
    decoder_num_heads: int | None = None
    """Decoder head count, for widths that do not tell it."""


STAGES: dict[str, tuple[type, str]] = {
    "pretrain": (PretrainConfig, "Pretrain a ViT encoder by masked autoencoding."),
    "linprobe": (LinprobeConfig, "Train a linear classifier on the frozen encoder's features."),
    "finetune": (FinetuneConfig, "Fine-tune the whole ViT with a fresh classifier head."),
    "knn": (KnnConfig, "Weighted k-NN classification with the frozen encoder's features."),
    "visualize": (VisualizeConfig, "Write original | masked | reconstruction grids for some images."),
    "export": (ExportConfig, "Write the encoder as safetensors with timm key names."),
    "convert": (ConvertConfig, "Convert another toolkit's MAE checkpoint to this project's safetensors."),
}


def build_parser(stage: str) -> ArgumentParser:
    config_cls, description = STAGES[stage]
    parser = ArgumentParser(prog=f"mae {stage}", description=description, exit_on_error=False, default_meta=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML (sparse: only what differs).")
    # A list of files reads best as `--images a.jpg b.jpg`, which needs argparse's nargs.
    lists = {"images"} if stage == "visualize" else set()
    positional = {"source"} if stage == "convert" else set()
    flags = {"attention"} if stage == "visualize" else set()  # `--attention` alone reads best
    parser.add_class_arguments(config_cls, fail_untyped=True, sub_configs=True, skip=lists | positional | flags)
    for name in flags:
        parser.add_argument(f"--{name}", action=ActionYesNo, default=False, help="Show attention maps.")
    for name in lists:
        parser.add_argument(f"--{name}", nargs="+", type=str, required=True, help="Image files.")
    for name in positional:
        parser.add_argument(name, type=str, help="The checkpoint to convert.")
    return parser


def parse(stage: str, argv: list[str]) -> Any:
    """Parse a stage's options into its frozen config dataclass."""
    parser = build_parser(stage)
    ns = parser.parse_args(argv)
    if stage == "pretrain" and ns.data.path is None:
        parser.set_defaults(DEMO_OVERRIDES)
        ns = parser.parse_args(argv)
        print(
            "mae pretrain: no --data.path given: training on the built-in demo photos (scikit-image)", file=sys.stderr
        )
    ns = parser.instantiate(ns) if hasattr(parser, "instantiate") else parser.instantiate_classes(ns)
    config_cls = STAGES[stage][0]
    return config_cls(**{f.name: ns[f.name] for f in fields(config_cls)})


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def run_stage(stage: str, cfg: Any) -> None:
    if stage == "pretrain":
        from mae.train.stages import run_pretrain

        run_pretrain(cfg)
    elif stage in ("linprobe", "finetune", "knn"):
        from mae.train import downstream

        getattr(downstream, f"run_{stage}")(cfg)
    elif stage == "visualize":
        from mae.train.stages import run_visualize

        run_visualize(cfg)
    elif stage == "export":
        from mae.export import export_encoder

        path = export_encoder(cfg.checkpoint, cfg.output, format=cfg.format)
        print(f"wrote {path}")
    elif stage == "convert":
        from mae.export import export_encoder, save_model
        from mae.importers import load_pretrained

        heads = {k: v for k, v in (("num_heads", cfg.num_heads), ("decoder_num_heads", cfg.decoder_num_heads)) if v}
        model = load_pretrained(cfg.source, **heads)
        path = export_encoder(model, cfg.output) if cfg.encoder_only else save_model(model, cfg.output)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        usage = "usage: mae {" + ",".join(STAGES) + "} [--config RECIPE.yaml] [--section.key VALUE ...]"
        lines = [usage, ""] + [f"  {name:<10} {desc}" for name, (_, desc) in STAGES.items()]
        if argv and argv[0] not in ("-h", "--help"):
            print(f"mae: error: unknown stage '{argv[0]}'; choose one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        print("\n".join(lines + ["", "mae <stage> --help lists every option."]))
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    try:
        cfg = parse(stage, rest)
        run_stage(stage, cfg)
    except (argparse.ArgumentError, ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        print(f"mae {stage}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"mae {stage}: stopped: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mae {stage}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
