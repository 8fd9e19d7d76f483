"""Masked autoencoder pretraining for timm Vision Transformers.

Models (`create_mae`, `list_presets`), weights in and out (`load_pretrained`, `export_encoder`, `load_encoder`),
and one function per stage (`pretrain`, `linprobe`, `finetune`, `knn`, `visualize`, `export`, `stats`, `convert`,
`shard`: the command line's stages, validated as it validates them). Every error a user can cause is a `MaeError`.
"""

from mae.api import anomaly, convert, export, finetune, knn, linprobe, predict, pretrain, shard, stats, visualize
from mae.errors import CheckpointError, ConfigError, DataError, MaeError, TrainingError
from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets
from mae.stages import StageResult, list_stages, register_stage
from mae.version import __version__
from mae.weights.classifier import load_classifier
from mae.weights.export import export_encoder, load_encoder
from mae.weights.importers import load_pretrained

__all__ = [
    "anomaly",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "MAEOutput",
    "MaeError",
    "MaskedAutoencoder",
    "StageResult",
    "TrainingError",
    "__version__",
    "convert",
    "create_mae",
    "export",
    "export_encoder",
    "finetune",
    "knn",
    "linprobe",
    "list_presets",
    "list_stages",
    "load_classifier",
    "load_encoder",
    "load_pretrained",
    "predict",
    "pretrain",
    "register_stage",
    "shard",
    "stats",
    "visualize",
]
