"""The stage registry: name -> config class, runner, one-line description. The CLI (`mae <stage>`) and the
Python API (`mae.pretrain(...)`, ...) both read it, so a stage registered here, from inside the package or
from a user's module, is a command and a function at once.

A runner takes its validated, frozen config and returns a `StageResult`. Registering is one decorator:

    @register_stage("mystage", MyConfig, "One line for `mae --help`.")
    def run_mystage(cfg: MyConfig) -> StageResult: ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from mae.config import check_config
from mae.errors import ConfigError
from mae.registry import Registry
from mae.run_folder import last_evaluation


@dataclass(frozen=True)
class StageResult:
    """What a stage leaves: its output folder, its last evaluation (e.g. {"top1": ...}), the weights it wrote."""

    output_dir: Path | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    export: Path | None = None


@dataclass(frozen=True)
class Stage:
    """A registered stage and how its options read on the command line."""

    name: str
    config: type
    run: Callable[[Any], StageResult]
    description: str
    positional: dict[str, str] = field(default_factory=dict)  # config fields read as positional words: help
    lists: dict[str, str] = field(default_factory=dict)  # fields given as `--name a b c`: help
    flags: dict[str, str] = field(default_factory=dict)  # booleans given as `--name` alone: help
    demo: dict[str, Any] | None = None  # defaults under the user's options when no --data.path is given

    def finalize(self, cfg: Any) -> Any:
        """The config as the runner gets it: every field's range checked, `output_dir` defaulted to
        outputs/<stage>."""
        if not isinstance(cfg, self.config):
            raise ConfigError(f"mae {self.name}: expected a {self.config.__name__}, got {type(cfg).__name__}")
        if "output_dir" in {f.name for f in fields(cfg)} and cfg.output_dir is None:
            cfg = replace(cfg, output_dir=f"outputs/{self.name}")
        check_config(cfg)
        return cfg

    def __call__(self, cfg: Any) -> StageResult:
        """Run the stage; a run that had nothing left to train (resumed at its end) reports the last evaluation its
        metrics.jsonl holds."""
        result = self.run(self.finalize(cfg))
        if not result.metrics and result.output_dir is not None:
            result = replace(result, metrics=last_evaluation(result.output_dir))
        return result


_STAGES: Registry[Stage] = Registry("stage")


def register_stage(name: str, config: type, description: str, **how: Any) -> Callable:
    """Decorator: make `run(cfg) -> StageResult` the stage `name` (`mae name ...`, `mae.name(...)`); `how`
    takes `Stage`'s `positional`, `lists`, `flags` and `demo`. A later registration of a name replaces it."""

    def add(run: Callable[[Any], StageResult]) -> Callable[[Any], StageResult]:
        _STAGES.register(name, Stage(name, config, run, description, **how))
        return run

    return add


def unregister_stage(name: str) -> None:
    _STAGES.unregister(name)


def get_stage(name: str) -> Stage:
    """The stage `name`; ConfigError naming the choices otherwise."""
    return _STAGES.get(name)


def list_stages() -> list[str]:
    """Stage names, in the order they were registered (the built-in ones first)."""
    return _STAGES.names()
