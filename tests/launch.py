"""Ports for launchers that take one (`accelerate launch --main_process_port`, torchrun's static rendezvous).

A port found free here may be taken by another test before the launcher binds it (tests run in parallel), so a
launch that failed on an address in use is run again on another port; torchrun's `--standalone` binds port 0
itself and needs none of this."""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Callable
from typing import Any

IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def free_port() -> int:
    """A port nothing listens on now (the OS picks it: bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_a_free_port(command: Callable[[int], list[str]], tries: int = 3, **run: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command(port), capture_output=True, text=True, **run)`, on a fresh port again while the
    launch fails because its port was taken meanwhile."""
    for _ in range(tries - 1):
        proc = subprocess.run(command(free_port()), capture_output=True, text=True, **run)
        if proc.returncode == 0 or not IN_USE.search(proc.stderr):
            return proc
    return subprocess.run(command(free_port()), capture_output=True, text=True, **run)
