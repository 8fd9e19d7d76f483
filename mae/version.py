"""The package version, in a module of its own: code that needs it imports it from here, which works
even where `mae` itself resolved to a namespace package (a `mae/` folder in the working directory)."""

__version__ = "0.1.0"
