from mae.models.mae import MAEOutput, MaskedAutoencoder
from mae.models.masking import Masking, random_masking
from mae.models.patches import patchify, unpatchify
from mae.models.registry import create_mae, list_presets

__all__ = [
    "MAEOutput",
    "MaskedAutoencoder",
    "Masking",
    "create_mae",
    "list_presets",
    "patchify",
    "random_masking",
    "unpatchify",
]
