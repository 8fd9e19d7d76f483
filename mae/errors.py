"""The errors a user can cause, one family: every one carries a one-line message that names the option,
file or value at fault and says what to do. The CLI prints that line; the Python API raises it."""

from __future__ import annotations

import re


class MaeError(Exception):
    """Base of every error this toolkit raises for bad input or a run that cannot go on."""


class ConfigError(MaeError, ValueError):
    """A bad option value; the message names the option, the value and what is allowed."""


class DataError(MaeError, ValueError):
    """Bad data input; the message names the path or option and says what to do."""


class ChannelError(DataError):
    """An image whose channel count is not the run's: an error that ends the run, not a file to skip."""


class CheckpointError(MaeError, ValueError):
    """A file that cannot be loaded as an MAE checkpoint; the message names it and says why."""


class TrainingError(MaeError, RuntimeError):
    """A run that cannot go on; the message says why and what to do."""


def one_line(message: object) -> str:
    """An error message as the one line the CLI prints and the API raises: its lines joined, and an argparse
    "arguments are required: output" naming the option as users type it ("--output")."""
    if "Original Traceback" in str(message):  # re-raised from a DataLoader worker: its cause, not its traceback
        last = [line.strip() for line in str(message).splitlines() if line.strip()][-1]
        return f"{last} (in a DataLoader worker)"
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return re.sub(
        r"(arguments are required: )(.*)$",
        lambda m: m.group(1) + ", ".join(_dashed(a) for a in m.group(2).split(", ")),
        text,
    )


def _dashed(name: str) -> str:
    """An option as users type it: `source` is positional, and a name already dashed stays as it is (so a message
    that went through `one_line` once reads the same after a second pass)."""
    return name if name == "source" or name.startswith("-") else f"--{name}"
