"""The model record in files: one writer (`spec_metadata`; `mae.models.spec.with_spec` for YAML/JSON documents)
and one reader (`read_spec`) for every artifact that carries a model. The record itself is
`mae.models.spec.ModelSpec`; here is only where it is kept:

| artifact | where |
|---|---|
| encoder, decoder, whole-model and classifier safetensors | string metadata `mae_spec` |
| a run folder or checkpoint | `config.yaml`'s top-level `mae_spec` |
| an hf folder | `config.json`'s top-level `mae_spec` (and its weights' metadata) |
| an ONNX model | `metadata_props` `mae_spec` |

Files written before the record existed (and other toolkits' files) have none: `read_spec` returns None for them,
and `load_pretrained` infers their architecture from the tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mae.errors import CheckpointError
from mae.models.spec import SPEC_KEY, ModelSpec, spec_of
from mae.run_folder import CONFIG, ENCODER, HF_CONFIG, HF_WEIGHTS, list_checkpoints
from mae.weights.files import read_metadata


def spec_metadata(spec: ModelSpec) -> dict[str, str]:
    """The record as string metadata (safetensors, ONNX)."""
    return {SPEC_KEY: spec.to_json()}


def read_spec(path: str | os.PathLike) -> ModelSpec | None:
    """The record of the model at `path`: a safetensors file, an ONNX file, a run folder (its config.yaml or its
    latest checkpoint's), a checkpoint folder, an hf folder; None when it has none (older or foreign files)."""
    try:
        return _read_spec(Path(path))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _read_spec(p: Path) -> ModelSpec | None:
    if p.is_dir():
        for candidate in (p / HF_CONFIG, p / CONFIG, *(c / CONFIG for c in list_checkpoints(p)[-1:])):
            if candidate.is_file() and (spec := spec_of(_document(candidate))) is not None:
                return spec
        weights = next((p / n for n in (ENCODER, HF_WEIGHTS) if (p / n).is_file()), None)
        return _read_spec(weights) if weights is not None else None
    if p.suffix == ".safetensors" and p.is_file():
        return spec_of(read_metadata(p))
    if p.suffix == ".onnx" and p.is_file():
        import onnx

        model = onnx.load(str(p), load_external_data=False)
        return spec_of({prop.key: prop.value for prop in model.metadata_props})
    return None


def _document(path: Path) -> dict[str, Any]:
    import yaml

    data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def file_spec(meta: dict[str, str], path: Path) -> ModelSpec | None:
    """The record in a safetensors file's metadata `meta` (read already), or None; CheckpointError when damaged."""
    try:
        return spec_of(meta)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
