"""Masked autoencoder pretraining for timm Vision Transformers."""

__version__ = "0.1.0"

from mae.export import export_encoder, load_encoder  # noqa: E402
from mae.importers import load_pretrained  # noqa: E402
from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets  # noqa: E402

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
