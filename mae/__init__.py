"""Masked autoencoder pretraining for timm Vision Transformers."""

from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets
from mae.version import __version__
from mae.weights.classifier import load_classifier
from mae.weights.export import export_encoder, load_encoder
from mae.weights.importers import load_pretrained

__all__ = [
    "MAEOutput",
    "MaskedAutoencoder",
    "__version__",
    "create_mae",
    "export_encoder",
    "list_presets",
    "load_classifier",
    "load_encoder",
    "load_pretrained",
]
