"""Masked autoencoder pretraining for timm Vision Transformers."""

from mae.export import export_encoder, load_encoder
from mae.importers import load_pretrained
from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets
from mae.version import __version__

__all__ = [
    "MAEOutput",
    "MaskedAutoencoder",
    "__version__",
    "create_mae",
    "export_encoder",
    "list_presets",
    "load_encoder",
    "load_pretrained",
]
