"""What every config field can carry and what every config can do: a constraint (`ranged` / `ruled`), checked by
`check_config` as soon as the options are parsed, in every stage alike; `to_dict` and `flatten` for config.yaml,
trackers and resume."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from mae.errors import ConfigError
from mae.models.spec import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401 - the record's default, the options' too


@dataclass(frozen=True)
class Rule:
    """What values a field accepts: `ok(value)` and the words that say it (`text`)."""

    ok: Callable[[Any], bool]
    text: str


def ruled(default: Any, ok: Callable[[Any], bool], text: str) -> Any:
    """A dataclass field whose non-null values must satisfy `ok`."""
    return field(default=default, metadata={"rule": Rule(ok, text)})


def ranged(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None
) -> Any:
    """A numeric field (or a tuple of numbers, each checked) within the given bounds."""

    def ok(value: Any) -> bool:
        values = value if isinstance(value, (tuple, list)) else (value,)
        return all(
            (ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le) and (lt is None or v < lt)
            for v in values
        )

    low = f"[{ge:g}" if ge is not None else (f"({gt:g}" if gt is not None else None)
    high = f"{le:g}]" if le is not None else (f"{lt:g})" if lt is not None else None)
    if low and high:
        text = f"in {low}, {high}"
    elif low:
        text = (">= " if ge is not None else "> ") + low[1:]
    else:
        text = ("<= " if le is not None else "< ") + high[:-1]
    return ruled(default, ok, text)


def crop_scale(default: tuple[float, float]) -> Any:
    """A RandomResizedCrop area range: 0 < min <= max <= 1."""
    return ruled(default, lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "0 < min <= max <= 1")


def check_config(cfg: Any, prefix: str = "") -> None:
    """Every field's own constraint, recursively; ConfigError names the first option out of range."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            check_config(value, f"{prefix}{f.name}.")
            continue
        rule = f.metadata.get("rule")
        if rule is not None and value is not None and not rule.ok(value):
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(f"--{prefix}{f.name} {shown}: must be {rule.text}")


def to_dict(cfg: Any, leaf: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """A plain, YAML-ready dict of a config (tuples as lists); its values are never copied (`asdict` deep-copies them,
    a dataset object too), and `leaf`, when given, turns each of them into what a record holds."""

    def plain(v: Any) -> Any:
        if is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return leaf(v) if leaf is not None else v

    return plain(cfg)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
