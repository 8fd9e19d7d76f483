"""The configuration of the stages that work on files rather than train: `mae visualize`, `mae stats`, `mae export`,
`mae convert` and `mae shard`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mae.config.fields import ranged
from mae.config.sections import ColumnsConfig, SourceConfig


@dataclass(frozen=True)
class VisualizeConfig:
    """mae visualize."""

    images: list[str]
    """Image files to show, or folders (the first 8 images of each, in name order)."""
    checkpoint: str | None = None
    """Reconstructions: a pretraining output folder, or any checkpoint `load_pretrained` reads."""
    pretrained: str | None = None
    """Attention maps (with --attention): an encoder export, an output folder, or any checkpoint."""
    attention: bool = False
    """Show the cls token's attention over the patches in the last block, per head and averaged."""
    output: str = "reconstructions.png"
    """Where the PNG grid goes."""
    mask_ratio: float | None = ranged(None, ge=0, lt=1)
    """Fraction of patches to mask; null = the model's."""
    masking: str | None = None
    """Mask generator (see mae pretrain --help); null = the run's (its config.yaml), else random."""
    bands: tuple[int, int, int] | None = ranged(None, ge=0)
    """Channels shown as red, green, blue for images of more than 3 channels; null = the run's preview bands."""
    seed: int = ranged(0, ge=0)
    """Seeds the masks."""


@dataclass(frozen=True)
class StatsModelConfig:
    """How the images are read."""

    in_chans: int | None = ranged(None, ge=1)
    """Channels per image, as in mae pretrain (3: RGB; 1: grayscale; N: multispectral); null = as many as the
    first readable file has (a 13-band .npy folder gives 13)."""


@dataclass(frozen=True)
class StatsConfig:
    """mae stats."""

    data: SourceConfig = field(default_factory=SourceConfig)
    model: StatsModelConfig = field(default_factory=StatsModelConfig)
    samples: int = ranged(1000, ge=1)
    """How many images (a seeded sample) to measure."""
    seed: int = ranged(0, ge=0)
    """Seeds the sample."""


@dataclass(frozen=True)
class ExportConfig:
    """mae export."""

    checkpoint: str
    """A pretraining output folder, a checkpoint, or any file `load_pretrained` reads."""
    output: str
    """The .safetensors file to write (the folder with --format hf-folder or --push_to_hub; the .onnx file with
    --format onnx)."""
    format: Literal["safetensors", "hf-folder", "onnx"] = "safetensors"
    """safetensors: one file; hf-folder: model.safetensors + timm config.json + model card; onnx: an ONNX model
    (encoder: pooled features and tokens; classifier: logits), batch axis free, checked with onnxruntime."""
    with_decoder: bool = False
    """Also write the MAE decoder beside the encoder (NAME.decoder.safetensors, or decoder.safetensors in an hf
    folder): load_pretrained of the export then reads the whole MAE back; timm reads the encoder file as before."""
    img_size: tuple[int, int] | None = ranged(None, ge=1)
    """Input size [H, W] of a checkpoint that does not record it (a non-square patch grid without metadata)."""
    opset: int = ranged(17, ge=14)
    """ONNX opset of --format onnx (17: LayerNorm as one op; onnxruntime >= 1.14)."""
    push_to_hub: str | None = None
    """OWNER/NAME: upload the hf folder written to --output to this Hugging Face model repo (token from HF_TOKEN
    or `hf auth login`); timm.create_model("hf-hub:OWNER/NAME", pretrained=True) then loads it."""
    private: bool = False
    """With --push_to_hub: create the repo private."""
    revision: str | None = None
    """With --push_to_hub: the branch to push to (created when missing); null = main."""
    license: str = "apache-2.0"
    """The license the model card states (a Hub license id: apache-2.0, mit, cc-by-4.0, other, ...)."""


@dataclass(frozen=True)
class ConvertConfig:
    """mae convert."""

    source: str
    """An official .pth, a transformers ViTMAE folder or file, a timm MAE encoder, or our own files."""
    output: str
    """The .safetensors file to write."""
    encoder_only: bool = False
    """Write only the encoder, as `mae export` does."""
    num_heads: int | None = ranged(None, ge=1)
    """Encoder head count, for widths that do not tell it."""
    decoder_num_heads: int | None = ranged(None, ge=1)
    """Decoder head count, for widths that do not tell it."""


@dataclass(frozen=True, kw_only=True)  # the columns come first: the fields after them have no default
class ShardConfig(ColumnsConfig):
    """mae shard."""

    source: str
    """What --data.path reads: an image folder (class subfolders give labeled shards), a `datasets` folder or
    hf:NAME[:split], or a shard set (to re-shard or pre-resize it)."""
    output: str
    """The folder to write the shards and their index.json into (new, or without an index)."""
    samples_per_shard: int = ranged(10_000, ge=1)
    """Samples per tar file (the last one holds the rest)."""
    max_size: int | None = ranged(None, ge=1)
    """Re-encode images whose longer side exceeds this many pixels down to it (aspect kept); null = store the
    files as they are. The originals are never modified."""
    labeled: bool | None = None
    """Write each sample's class (KEY.cls); null = when the source is labeled (class subfolders, a label column)."""
    shuffle: bool = True
    """Write the samples in a seeded random order (the reader shuffles within a few shards at a time)."""
    seed: int = ranged(0, ge=0)
    """Seeds the order."""
