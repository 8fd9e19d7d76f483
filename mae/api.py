"""The Python API of the stages: `mae.pretrain(config=None, **overrides)`, and one function per stage.

Each goes through the same parser as `mae <stage>`, so a call is validated exactly as the command line is:

    result = mae.pretrain("recipes/pretrain/small_folder_cpu.yaml", data={"path": "imgs"}, loop={"epochs": 2})
    result.output_dir, result.metrics, result.export

`config` is a recipe path or a config object; an override is a top-level field (`output_dir="runs/a"`,
`seed=1`, `pretrained=...`) or a section as a dict (`data={"path": ...}`), applied over the recipe as
command-line options are. Bad input raises a `mae.MaeError` subclass carrying the CLI's one-line message.
"""

from __future__ import annotations

import json
import sys
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from accelerate.state import AcceleratorState

from mae.cli import parse
from mae.config import flatten, to_dict
from mae.data.open import remember_dataset
from mae.errors import ConfigError
from mae.stages import StageResult, get_stage, list_stages


def run(stage: str, config: str | Path | Any = None, **overrides: Any) -> StageResult:
    """Run `stage` (a name `list_stages()` gives) with a recipe or config object and overrides."""
    s = get_stage(stage)
    argv: list[str] = []
    if isinstance(config, (str, Path)):
        if not Path(config).is_file():
            raise ConfigError(f"config {config}: no such recipe file")
        argv += ["--config", str(config)]
    elif config is not None:
        if not isinstance(config, s.config):
            raise ConfigError(f"config: expected a recipe path or a {s.config.__name__}, got {type(config).__name__}")
        argv += _options(flatten(to_dict(config)), s)
    argv += _options(flatten({k: _plain(v) for k, v in overrides.items()}), s)
    cfg = parse(stage, argv)
    # One process may run several stages, each with its own precision: Accelerate keeps one state per process,
    # which only this (private) reset lets a new stage set up afresh.
    AcceleratorState._reset_state(reset_partial_state=True)
    return s(cfg)


def _plain(value: Any) -> Any:
    """A section given as a config object becomes a dict, as a recipe would state it; a `datasets.Dataset` (as a data
    path) a token that the data factory resolves in this process."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(value, datasets.Dataset):
        return remember_dataset(value)
    return value


def _options(values: dict[str, Any], stage: Any) -> list[str]:
    """Command-line words for dotted keys: `--key value`, positional words and `--flag` as the stage reads them."""
    words: list[str] = []
    for key, value in values.items():
        if key in stage.positional:
            words.append(str(value))
        elif key in stage.flags:
            words += [f"--{key}"] if value else []
        elif key in stage.lists:
            words += [f"--{key}", *map(str, value if isinstance(value, (list, tuple)) else [value])]
        else:
            words += [f"--{key}", str(value) if isinstance(value, (str, Path)) else json.dumps(_jsonable(value))]
    return words


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _stage_function(name: str):
    def stage_function(config: str | Path | Any = None, **overrides: Any) -> StageResult:
        return run(name, config, **overrides)

    stage_function.__name__ = stage_function.__qualname__ = name
    stage_function.__doc__ = (
        f"{get_stage(name).description}\n\nSee `mae.api.run`: `mae {name} --help` lists the options."
    )
    return stage_function


pretrain = _stage_function("pretrain")
linprobe = _stage_function("linprobe")
finetune = _stage_function("finetune")
knn = _stage_function("knn")
visualize = _stage_function("visualize")
export = _stage_function("export")
stats = _stage_function("stats")
convert = _stage_function("convert")
shard = _stage_function("shard")
predict = _stage_function("predict")
anomaly = _stage_function("anomaly")

__all__ = ["run", "list_stages", *(n for n in ("pretrain", "linprobe", "finetune", "knn", "visualize", "export",
                                               "stats", "convert", "shard", "predict", "anomaly"))]  # fmt: skip
