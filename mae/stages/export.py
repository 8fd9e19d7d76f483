"""`mae export`: a run's or checkpoint's encoder (with its decoder, if asked) or a trained classifier, as
safetensors with timm key names, an hf folder (pushed to the Hugging Face Hub, if asked), or ONNX."""

from __future__ import annotations

from pathlib import Path

from mae.config import ConfigError, ExportConfig
from mae.stages.registry import StageResult, register_stage
from mae.weights.classifier import classifier_file, export_classifier
from mae.weights.export import export_encoder


@register_stage(
    "export",
    ExportConfig,
    "Write an encoder or a classifier as safetensors, an hf folder (pushed to the Hub) or ONNX.",
    flags={
        "with_decoder": "Also write the MAE decoder beside the encoder (load_pretrained reads it back).",
        "private": "With --push_to_hub: create the repo private.",
    },
)
def run_export(cfg: ExportConfig) -> StageResult:
    fmt = "hf-folder" if cfg.push_to_hub else cfg.format
    check(cfg)
    if cfg.push_to_hub:  # no token, no work: say so before writing anything
        from mae.weights.hub import hub_token

        hub_token()
    if fmt == "onnx":
        from mae.weights.onnx import export_onnx

        path = export_onnx(cfg.checkpoint, cfg.output, img_size=cfg.img_size, opset=cfg.opset)
    elif classifier_file(cfg.checkpoint) is not None:
        path = export_classifier(cfg.checkpoint, cfg.output, fmt, license=cfg.license)
    else:
        path = export_encoder(cfg.checkpoint, cfg.output, fmt, with_decoder=cfg.with_decoder, license=cfg.license)
    print(f"wrote {path}")
    if cfg.push_to_hub:
        from mae.weights.hub import push_to_hub

        url = push_to_hub(path, cfg.push_to_hub, private=cfg.private, revision=cfg.revision)
        print(f"pushed to https://huggingface.co/{cfg.push_to_hub} ({url})")
    return StageResult(export=Path(path))


def check(cfg: ExportConfig) -> None:
    """Options that contradict each other, or a checkpoint that is not there."""
    if cfg.push_to_hub and cfg.format == "onnx":
        raise ConfigError("--push_to_hub uploads an hf folder; leave out --format onnx (or export ONNX separately)")
    if not Path(cfg.checkpoint).exists():
        raise ConfigError(f"--checkpoint {cfg.checkpoint}: no such file or folder")
    if cfg.with_decoder and (cfg.format == "onnx" or classifier_file(cfg.checkpoint) is not None):
        raise ConfigError("--with_decoder: only an encoder export (safetensors or hf-folder) carries the decoder")
