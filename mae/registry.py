"""One small registry for every extension point (stages, data-source kinds, masks, decoders,
presets): names to objects, with one way to register, look up, list and refuse.

    MASKS: Registry[MaskGenerator] = Registry("masking")
    MASKS.register("stripes", stripes)
    MASKS.get("stripes")   # stripes; MASKS.get("nope"): ConfigError: unknown masking 'nope'; choose one of: ...
    MASKS.names()          # in registration order

A later registration of a name replaces the earlier one and counts as the latest (registries that ask their
entries in turn, such as data-source kinds, ask the latest first). Model code imports this module, so it imports
nothing of the package but its errors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from mae.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> objects of one `kind` (the word its messages use: "stage", "masking", "decoder", ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, obj: T, *, aliases: Iterable[str] = ()) -> T:
        """Add `obj` as `name` (and under each alias); returns `obj`, so it can end a decorator."""
        self._items.pop(name, None)
        self._items[name] = obj
        self._aliases.update(dict.fromkeys(aliases, name))
        return obj

    def unregister(self, name: str) -> None:
        """Forget `name` and its aliases (tests register entries of their own and remove them after)."""
        self._items.pop(name, None)
        self._aliases = {alias: target for alias, target in self._aliases.items() if target != name}

    def resolve(self, name: str) -> str:
        """The registered name `name` stands for (itself, or the name an alias points to); `unknown` otherwise."""
        name = self._aliases.get(name, name)
        if name not in self._items:
            raise self.unknown(name)
        return name

    def get(self, name: str) -> T:
        """The object registered as `name` (or an alias of it); ConfigError naming the choices otherwise."""
        return self._items[self.resolve(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._aliases

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._items)

    def aliases(self) -> list[str]:
        """The other names that stand for registered ones, in registration order."""
        return list(self._aliases)

    def values(self) -> list[T]:
        """The registered objects in registration order (the latest last)."""
        return list(self._items.values())

    def unknown(self, name: str, *, also: str = "") -> ConfigError:
        """The one-line error for a name not registered: it names the kind, the name and the choices (sorted),
        then `also` (other accepted values, e.g. "or a timm ViT architecture")."""
        choices = ", ".join(sorted(self.names() + self.aliases()))
        return ConfigError(f"unknown {self.kind} '{name}'; choose one of: {choices}{', ' + also if also else ''}")
