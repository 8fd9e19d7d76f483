"""`mae export`: a run's or checkpoint's encoder as safetensors with timm key names (or an hf folder)."""

from __future__ import annotations

from pathlib import Path

from mae.config import ExportConfig
from mae.stages.registry import StageResult, register_stage
from mae.weights.export import export_encoder


@register_stage("export", ExportConfig, "Write the encoder as safetensors with timm key names.")
def run_export(cfg: ExportConfig) -> StageResult:
    path = export_encoder(cfg.checkpoint, cfg.output, format=cfg.format)
    print(f"wrote {path}")
    return StageResult(export=Path(path))
