from mae.models.decoder import check_decoder, list_decoders, register_decoder, unregister_decoder
from mae.models.encoder import EncoderAdapter, EncoderSpec, encoder_adapter
from mae.models.mae import MAEOutput, MaskedAutoencoder
from mae.models.masking import Masking, random_masking
from mae.models.patches import patchify, unpatchify
from mae.models.registry import create_mae, list_presets

__all__ = [
    "EncoderAdapter",
    "EncoderSpec",
    "MAEOutput",
    "MaskedAutoencoder",
    "Masking",
    "check_decoder",
    "create_mae",
    "encoder_adapter",
    "list_decoders",
    "list_presets",
    "patchify",
    "random_masking",
    "register_decoder",
    "unpatchify",
    "unregister_decoder",
]
