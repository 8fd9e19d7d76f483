"""Masked autoencoder pretraining for timm Vision Transformers."""

__version__ = "0.1.0"

from mae.models import MAEOutput, MaskedAutoencoder, create_mae, list_presets  # noqa: E402

__all__ = ["MAEOutput", "MaskedAutoencoder", "__version__", "create_mae", "list_presets"]
