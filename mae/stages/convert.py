"""`mae convert`: another toolkit's MAE checkpoint as this project's safetensors."""

from __future__ import annotations

from pathlib import Path

from mae.config import ConvertConfig
from mae.stages.registry import StageResult, register_stage
from mae.weights.export import export_encoder, save_model
from mae.weights.importers import load_noting_decoder


@register_stage(
    "convert",
    ConvertConfig,
    "Convert another toolkit's MAE checkpoint to this project's safetensors.",
    positional={"source": "The checkpoint to convert."},
)
def run_convert(cfg: ConvertConfig) -> StageResult:
    """The whole MAE as one file; a source without decoder weights as the encoder export `mae export` writes."""
    heads = {k: v for k, v in (("num_heads", cfg.num_heads), ("decoder_num_heads", cfg.decoder_num_heads)) if v}
    model, has_decoder = load_noting_decoder(cfg.source, **heads)
    # Without decoder weights a full-model file would carry a freshly initialised decoder that every reader takes
    # for a trained one: such a source is written as the encoder export `mae export` writes, which readers know.
    encoder_only = cfg.encoder_only or not has_decoder
    path = export_encoder(model, cfg.output) if encoder_only else save_model(model, cfg.output)
    if cfg.encoder_only or has_decoder:
        print(f"wrote {path}")
    else:
        print(
            f"wrote {path} encoder-only: {cfg.source} holds no decoder weights (reconstructions and `mae anomaly "
            "--score recon` need a file with its trained decoder)"
        )
    return StageResult(export=Path(path))
