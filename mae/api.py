"""The Python API of the stages: `mae.pretrain(config=None, **overrides)`, and one such function per registered
stage, plugins included (`stage_function(name)`; `mae.<name>` and `mae.api.<name>` hand it out).

The command line (`mae <stage>`) is a front over the same stages: a call builds the stage's config from Python
values and validates it with the parser the command line uses, so it is refused exactly as the command line is:

    result = mae.pretrain("recipes/pretrain/small_folder_cpu.yaml", data={"path": "imgs"}, loop={"epochs": 2})
    result.output_dir, result.metrics, result.export

`config` is a recipe path or a config object; an override is a top-level field (`output_dir="runs/a"`,
`seed=1`, `pretrained=...`) or a section as a dict (`data={"path": ...}`), applied over the recipe as
command-line options are. A `datasets.Dataset` object is a data path too (`data={"path": ds}`). Bad input raises
a `mae.MaeError` subclass carrying the CLI's one-line message.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from mae.plugins import load_plugins
from mae.stages import StageResult, get_stage, list_stages
from mae.stages.options import build

__all__ = ["list_stages", "run", "stage_function"]


def run(stage: str, config: str | os.PathLike | Any = None, **overrides: Any) -> StageResult:
    """Run `stage` (a name `list_stages()` gives) with a recipe or config object and overrides."""
    load_plugins()
    return get_stage(stage)(build(stage, config, overrides))


@functools.cache
def stage_function(name: str) -> Callable[..., StageResult]:
    """`mae.<name>`: the function that runs the stage `name` (`run(name, config, **overrides)`)."""

    def stage_function(config: str | os.PathLike | Any = None, **overrides: Any) -> StageResult:
        return run(name, config, **overrides)

    stage_function.__name__ = stage_function.__qualname__ = name
    stage_function.__module__ = "mae"
    stage_function.__doc__ = (
        f"{get_stage(name).description}\n\n`config`: a recipe path or a {get_stage(name).config.__name__}; "
        f"`overrides`: top-level fields or sections as dicts. `mae {name} --help` lists the options."
    )
    return stage_function


def registered_stage(name: str) -> Callable[..., StageResult] | None:
    """The function of the stage `name` if one is registered, plugins included; None otherwise."""
    if name.startswith("_"):  # Python's own lookups (`__path__`, `__wrapped__`, ...) are never stages
        return None
    if name not in list_stages():
        load_plugins()
    return stage_function(name) if name in list_stages() else None


def __getattr__(name: str) -> Callable[..., StageResult]:
    """`mae.api.pretrain`, ...: any registered stage."""
    found = registered_stage(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found
