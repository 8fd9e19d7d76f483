"""Masked autoencoder pretraining for timm Vision Transformers.

Models (`create_mae`, `list_presets`) and their record (`ModelSpec`, `read_spec`), weights in and out
(`load_pretrained`, `export_encoder`, `load_encoder`, `load_classifier`, `load_segmenter`),
and one function per registered stage, plugins included (`mae.pretrain(...)`, `mae.linprobe(...)`, ...: the command
line's stages, validated as it validates them; `list_stages()` names them). Every error a user can cause is a
`MaeError`.
"""

from mae.api import registered_stage as _registered_stage
from mae.errors import CheckpointError, ConfigError, DataError, MaeError, TrainingError
from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets
from mae.models.spec import ModelSpec
from mae.stages import StageResult, list_stages, register_stage
from mae.version import __version__
from mae.weights.classifier import load_classifier
from mae.weights.export import export_encoder, load_encoder
from mae.weights.importers import load_pretrained
from mae.weights.record import read_spec
from mae.weights.segmenter import load_segmenter

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "MAEOutput",
    "MaeError",
    "MaskedAutoencoder",
    "ModelSpec",
    "StageResult",
    "TrainingError",
    "__version__",
    "create_mae",
    "export_encoder",
    "list_presets",
    "list_stages",
    "load_classifier",
    "load_encoder",
    "load_pretrained",
    "load_segmenter",
    "read_spec",
    "register_stage",
    *list_stages(),  # the stages registered on import; a plugin's are reached by name (`__getattr__`)
]


def __getattr__(name: str):
    """`mae.pretrain`, `from mae import knn`, `mae.<plugin stage>`: the function of any registered stage."""
    found = _registered_stage(name)
    if found is None:
        raise AttributeError(f"module 'mae' has no attribute {name!r}")
    return found


def __dir__() -> list[str]:
    from mae.plugins import load_plugins

    load_plugins()  # a plugin's stages are names of the package too
    return sorted(set(globals()) | set(list_stages()))
