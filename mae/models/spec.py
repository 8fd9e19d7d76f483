"""`ModelSpec`: THE record of a model, what builds it and what it expects as input.

Its fields are `MaskedAutoencoder`'s constructor arguments, resolved (no "keep the preset's" None left), plus the
input's normalisation: `MaskedAutoencoder(**spec.model_args())` rebuilds the model, `model.spec` gives it back.
Every artifact that carries a model (a run's config.yaml, encoder, decoder and whole-model safetensors, classifier
exports, the hf folder's config.json, ONNX metadata) stores `spec.to_dict()` under `SPEC_KEY`, and `from_dict`
reads it back; nothing else restates an architecture or its statistics.

Statistics: `mean` and `std` are None when nobody recorded them (a foreign checkpoint). The one rule for that case
is `input_stats`: ImageNet's for 3 channels (the convention of every RGB ViT checkpoint), none for any other
channel count (the stage asks for --data.mean / --data.std).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# Where every artifact keeps the record (a safetensors metadata key, a config.json / config.yaml key, ONNX metadata).
SPEC_KEY = "mae_spec"

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ModelSpec:
    """A masked autoencoder as data: the timm encoder architecture and its sizes, the decoder, the pretext task and
    the input (channels, statistics). Frozen; `replace` makes variants."""

    encoder_arch: str = "vit_base_patch16_224"  # the timm architecture of the encoder (prefix tokens, MLP kind)
    img_size: tuple[int, int] = (224, 224)  # input (height, width), multiples of patch_size
    patch_size: int = 16
    in_chans: int = 3
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float | None = 4.0  # None: the architecture's own (a gated MLP's)
    decoder: str = "mae"  # a registered decoder (`list_decoders()`)
    decoder_embed_dim: int = 512
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    decoder_mlp_ratio: float = 4.0
    predict_ratio: float = 1.0  # the share of the masked patches a decoder predicts (CrossMAE's; 1 = all)
    mask_ratio: float = 0.75
    norm_pix_loss: bool = True  # targets are per-patch normalised pixels (`MaskedAutoencoder.forward_target`)
    mean: tuple[float, ...] | None = None  # per-channel input normalisation (pixels in [0, 1]); None = not recorded
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        # One canonical form whatever the source (JSON lists, YAML ints), so that equal specs compare equal.
        size = self.img_size
        object.__setattr__(self, "img_size", (int(size), int(size)) if isinstance(size, int) else tuple(map(int, size)))
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))

    def model_args(self) -> dict[str, Any]:
        """`MaskedAutoencoder`'s keyword arguments (every field)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML data (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """The spec a `to_dict` wrote; a field this version does not know (a newer toolkit's) is ignored, warned."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"model record: ignoring fields this version does not know: {unknown}", stacklevel=2)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        return cls.from_dict(json.loads(text))

    def with_stats(self, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> ModelSpec:
        """This spec with the given statistics (None keeps the recorded ones)."""
        return replace(self, mean=self.mean if mean is None else mean, std=self.std if std is None else std)

    def input_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(mean, std) the model expects: the recorded ones, else ImageNet's for 3 channels, else None (unknown:
        the caller asks the user for them)."""
        if self.mean is not None and self.std is not None:
            return self.mean, self.std
        if self.in_chans == 3:
            return self.mean or IMAGENET_MEAN, self.std or IMAGENET_STD
        return None

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patches per (column, row): L = gh * gw."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size


def with_spec(document: dict[str, Any], spec: ModelSpec | None) -> dict[str, Any]:
    """A YAML/JSON document (a run's config.yaml, an hf folder's config.json) with the record added."""
    return document if spec is None else {**document, SPEC_KEY: spec.to_dict()}


def spec_of(document: dict[str, Any] | None) -> ModelSpec | None:
    """The record in a string-metadata dict (JSON text) or a parsed YAML/JSON document (a mapping), or None.
    ValueError when it is damaged."""
    value = (document or {}).get(SPEC_KEY)
    if value is None:
        return None
    try:
        return ModelSpec.from_dict(json.loads(value) if isinstance(value, str) else value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the model record ({SPEC_KEY}) is damaged: {e}") from None
