"""Plugins: modules that register stages, data-source kinds, masks, decoders or encoders from outside the
package, imported before the command line is read. Name them in `MAE_PLUGINS` (comma-separated module names,
importable from the working directory or the Python path), or install a package that declares an entry point in
the `mae.plugins` group. In Python, importing the module that registers them is enough."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from importlib.metadata import entry_points

from mae.errors import ConfigError

ENV = "MAE_PLUGINS"
GROUP = "mae.plugins"


@functools.cache
def load_plugins() -> tuple[str, ...]:
    """Import every plugin once per process; returns their names. A plugin that fails to import ends the run
    with one line naming it."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `mae` as a console script: a plugin module beside the user's recipes
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever the plugin raised, the user needs its name and the reason
            raise ConfigError(f"{ENV}: cannot import plugin module '{name}' ({type(e).__name__}: {e})") from None
    for point in entry_points(group=GROUP):
        try:
            point.load()
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"plugin {point.name} ({point.value}): cannot be loaded ({type(e).__name__}: {e})"
            ) from None
        names.append(point.name)
    return tuple(names)
