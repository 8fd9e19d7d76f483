"""`mae <stage> [--config RECIPE.yaml] [--section.key VALUE ...]`: parse, validate, dispatch.

The stages come from `mae.stages` (the registry); plugins named in `MAE_PLUGINS` or installed under the
`mae.plugins` entry point are imported first, so their stages, sources, masks and decoders are there too.
Precedence: dataclass defaults < (demo settings, when no data is given) < YAML < command line.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import traceback
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, set_parsing_settings

from mae.errors import ConfigError, MaeError, TrainingError, one_line
from mae.plugins import load_plugins
from mae.run_folder import error_log
from mae.stages import get_stage, list_stages

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
    """Parse a stage's options into its frozen config dataclass, every range checked."""
    s = get_stage(stage)
    parser = build_parser(stage)
    try:
        # jsonargparse prints the config and exits while parsing --print_config: decide "demo or not" without
        # it, so that what it prints is what the demo then runs.
        printing = [a for a in argv if a.startswith("--print_config")]
        ns = parser.parse_args([a for a in argv if a not in printing])
        demo = s.demo is not None and ns.data.path is None
        if demo:  # the demo's settings, under the user's own options
            parser.set_defaults(s.demo)
        if demo or printing:
            ns = parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(one_line(e)) from None
    ns = parser.instantiate(ns) if hasattr(parser, "instantiate") else parser.instantiate_classes(ns)
    cfg = s.finalize(s.config(**{f.name: ns[f.name] for f in fields(s.config)}))
    if demo:
        print(
            f"mae {stage}: no --data.path given: training on the built-in demo photos (scikit-image)", file=sys.stderr
        )
    return cfg


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
