"""A stage's options: one jsonargparse parser per stage, read from its config dataclass, and the one way a frozen
config is made from options, whether they come as command-line words (`parse`, for `mae <stage>`) or as Python
values (`build`, for `mae.<stage>(...)`). Both validate with the same parser, so an unknown key, a wrong type or a
value out of range fails alike, with the same one line.

Precedence: dataclass defaults < (demo settings, when no data is given) < recipe < options.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, Namespace, set_parsing_settings

from mae.data.open import is_dataset_object, recorded_path
from mae.errors import ConfigError, one_line
from mae.stages.registry import Stage, get_stage

# Each config field's docstring is its --help text.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


def build_parser(stage: str) -> ArgumentParser:
    """The stage's parser: its config's fields as `--section.key` options (docstrings as help), plus the
    positional words, lists and flags the stage declares."""
    s = get_stage(stage)
    parser = ArgumentParser(prog=f"mae {stage}", description=s.description, exit_on_error=False, default_meta=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML (sparse: only what differs).")
    manual = set(s.positional) | set(s.lists) | set(s.flags)
    parser.add_class_arguments(s.config, fail_untyped=True, sub_configs=True, skip=manual)
    for name, help in s.flags.items():  # `--attention` alone reads best
        parser.add_argument(f"--{name}", action=ActionYesNo, default=False, help=help)
    optional = {f.name for f in fields(s.config) if f.default is not MISSING or f.default_factory is not MISSING}
    for name, help in s.lists.items():  # a list of files reads best as `--images a.jpg b.jpg`
        parser.add_argument(f"--{name}", nargs="+", type=str, required=name not in optional, help=help)
    for name, help in s.positional.items():
        parser.add_argument(name, type=str, help=help)
    return parser


def parse(stage: str, argv: list[str]) -> Any:
    """The command line's words (`--config RECIPE`, `--section.key VALUE`, ...) as the stage's frozen config, every
    range checked. `--print_config` prints the resolved config (the demo's, when it applies) and exits."""
    s, parser = get_stage(stage), build_parser(stage)
    # jsonargparse prints the config and exits while parsing --print_config: decide "demo or not" without it, so
    # that what it prints is what the demo then runs.
    printing = [a for a in argv if a.startswith("--print_config")]
    ns, demo = _validated(s, parser, lambda: parser.parse_args([a for a in argv if a not in printing]))
    if printing:
        ns = _checked(lambda: parser.parse_args(argv))
    return _config(s, parser, ns, demo, {})


def build(stage: str, config: str | os.PathLike | Any = None, overrides: dict[str, Any] | None = None) -> Any:
    """The Python API's options as the stage's frozen config: `config` a recipe path or a config object of the
    stage, `overrides` top-level fields or sections as dicts (merged over the recipe's sections, as dotted
    command-line options are). A `datasets.Dataset` object given as a data path reaches the stage as it is."""
    s = get_stage(stage)
    parser = build_parser(stage)
    values = _merged(_base(s, parser, config), _as_dicts(overrides or {}))
    objects: dict[str, Any] = {}
    values = _plain(values, "", objects)
    ns, demo = _validated(s, parser, lambda: parser.parse_object(values))
    return _config(s, parser, ns, demo, objects)


def _base(s: Stage, parser: ArgumentParser, config: Any) -> dict[str, Any]:
    """What `config` states, as nested dicts: a recipe's keys (read as `--config` reads them), or a config
    object's every field."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        if not Path(config).is_file():
            raise ConfigError(f"config {config}: no such recipe file")
        return _checked(lambda: parser.parse_path(os.fspath(config), defaults=False)).as_dict()
    if not isinstance(config, s.config):
        raise ConfigError(f"config: expected a recipe path or a {s.config.__name__}, got {type(config).__name__}")
    return _as_dicts(config)


def _as_dicts(value: Any) -> Any:
    """Config objects (a whole config, or a section) as nested dicts; the values themselves are not copied
    (`dataclasses.asdict` would deep-copy a dataset)."""
    if is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, dict):
        return {k: _as_dicts(v) for k, v in value.items()}
    return value


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base`, section by section: `loop={"epochs": 2}` keeps the recipe's other loop keys."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def _plain(value: Any, key: str, objects: dict[str, Any]) -> Any:
    """Values as the parser reads them (paths as strings, tuples as lists); a `datasets.Dataset` object is kept
    out of the parse (its stand-in, a string, is parsed) and noted in `objects` under its dotted key."""
    if isinstance(value, dict):
        return {k: _plain(v, f"{key}.{k}" if key else k, objects) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if any(map(is_dataset_object, value)):
            raise ConfigError(f"--{key}: a datasets.Dataset object goes where one data path goes, not in a list")
        return [_plain(v, key, objects) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if is_dataset_object(value):
        objects[key] = value
        return recorded_path(value)
    return value


def _checked(parsing: Any) -> Any:
    """Run `parsing()`; jsonargparse's refusal as the one-line ConfigError the CLI prints and the API raises."""
    try:
        return parsing()
    except argparse.ArgumentError as e:
        raise ConfigError(one_line(e)) from None


def _validated(s: Stage, parser: ArgumentParser, parsing: Any) -> tuple[Namespace, bool]:
    """The parsed options, and whether they run the demo: with no data path, the stage's demo settings go under
    the user's own options and the options are parsed again."""
    ns = _checked(parsing)
    demo = s.demo is not None and ns.data.path is None
    if demo:
        parser.set_defaults(s.demo)
        ns = _checked(parsing)
    return ns, demo


def _config(s: Stage, parser: ArgumentParser, ns: Namespace, demo: bool, objects: dict[str, Any]) -> Any:
    """The frozen config of parsed options, the objects put back where their stand-ins were, every range checked."""
    ns = parser.instantiate(ns) if hasattr(parser, "instantiate") else parser.instantiate_classes(ns)
    cfg = s.config(**{f.name: ns[f.name] for f in fields(s.config)})
    for key, obj in objects.items():
        cfg = _put(cfg, key.split("."), obj)
    cfg = s.finalize(cfg)
    if demo:
        print(
            f"mae {s.name}: no --data.path given: training on the built-in demo photos (scikit-image)", file=sys.stderr
        )
    return cfg


def _put(cfg: Any, keys: list[str], value: Any) -> Any:
    """`cfg` (frozen, sections nested) with the field at the dotted `keys` set to `value`."""
    head, rest = keys[0], keys[1:]
    return replace(cfg, **{head: _put(getattr(cfg, head), rest, value) if rest else value})
