"""`mae convert`: another toolkit's MAE checkpoint as this project's safetensors."""

from __future__ import annotations

from pathlib import Path

from mae.config import ConvertConfig
from mae.stages.registry import StageResult, register_stage
from mae.weights.export import export_encoder, save_model
from mae.weights.importers import load_pretrained


@register_stage(
    "convert",
    ConvertConfig,
    "Convert another toolkit's MAE checkpoint to this project's safetensors.",
    positional={"source": "The checkpoint to convert."},
)
def run_convert(cfg: ConvertConfig) -> StageResult:
    heads = {k: v for k, v in (("num_heads", cfg.num_heads), ("decoder_num_heads", cfg.decoder_num_heads)) if v}
    model = load_pretrained(cfg.source, **heads)
    path = export_encoder(model, cfg.output) if cfg.encoder_only else save_model(model, cfg.output)
    print(f"wrote {path}")
    return StageResult(export=Path(path))
