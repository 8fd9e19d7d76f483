"""`mae <stage> [--config RECIPE.yaml] [--section.key VALUE ...]`: a thin front over the stages.

The stages come from `mae.stages` (the registry); plugins named in `MAE_PLUGINS` or installed under the
`mae.plugins` entry point are imported first, so their stages, sources, masks and decoders are there too.
The words are read by the stage's parser (`mae.stages.options`, which the Python API validates with too:
defaults < demo settings when no data is given < recipe < command line), the stage runs, and what goes wrong
ends as one line and an exit status.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from mae.errors import ConfigError, MaeError, TrainingError, one_line
from mae.plugins import load_plugins
from mae.run_folder import error_log
from mae.stages import get_stage, list_stages
from mae.stages.options import build_parser, parse

__all__ = ["build_parser", "main", "parse"]


def _cause(e: BaseException) -> str:
    """One line naming what failed: for an error re-raised from a DataLoader worker, the original
    exception's last line, not the whole worker traceback."""
    text = str(e)
    if "Original Traceback" in text:
        return one_line(text)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _save_traceback(cfg: Any) -> Path | None:
    """The full traceback of the exception being handled, in the run's folder (one file per rank)."""
    folder = getattr(cfg, "output_dir", None)
    if not folder or not Path(folder).is_dir():
        return None
    path = error_log(folder, int(os.environ.get("RANK", "0")))
    try:
        path.write_text(traceback.format_exc())
    except OSError:
        return None
    return path


def _end_worker_processes() -> None:
    """Kill what is left of DataLoader workers before multiprocessing's exit handler joins them.

    After an exception the loader iterators stay referenced from the traceback, so their workers are
    still alive at exit; multiprocessing then sends them SIGTERM, which they ignore (stop signals are
    left to the training process), and joins them forever. Registered after multiprocessing's own
    handler, this one runs first (atexit is last-in, first-out).
    """
    import multiprocessing
    import signal

    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    # torch's SIGCHLD handler would report the killed workers as a crash: silence it meanwhile.
    try:
        previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread
        previous = None
    for p in children:
        p.kill()
    for p in children:
        p.join(timeout=5)
    if previous is not None:
        signal.signal(signal.SIGCHLD, previous)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        load_plugins()
    except ConfigError as e:
        print(f"mae: error: {e}", file=sys.stderr)
        return 2
    stages = list_stages()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in stages:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"mae: error: unknown stage '{argv[0]}'; choose one of {', '.join(stages)}", file=sys.stderr)
            return 2
        usage = "usage: mae {" + ",".join(stages) + "} [--config RECIPE.yaml] [--section.key VALUE ...]"
        lines = [usage, ""] + [f"  {name:<10} {get_stage(name).description}" for name in stages]
        print("\n".join(lines + ["", "mae <stage> --help lists every option."]))
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    import multiprocessing.util  # noqa: F401 - its exit handler must be registered before ours

    atexit.register(_end_worker_processes)
    cfg = None
    try:
        cfg = parse(stage, rest)
        get_stage(stage)(cfg)
    except TrainingError as e:
        print(f"mae {stage}: stopped: {one_line(e)}", file=sys.stderr)
        return 1
    except (MaeError, FileNotFoundError) as e:
        print(f"mae {stage}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mae {stage}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - whatever broke, the run ends with one line and exit 1, never hangs
        log = _save_traceback(cfg)
        where = f" (traceback in {log})" if log else ""
        print(f"mae {stage}: failed: {_cause(e)}{where}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
