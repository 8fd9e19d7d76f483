"""`mae <stage> [--config RECIPE.yaml] [--section.key VALUE ...]`: parse, validate, dispatch.

Precedence: dataclass defaults < (demo settings, when no data is given) < YAML < command line.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import sys
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any

from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser, set_parsing_settings

from mae.config import (
    DEMO_OVERRIDES,
    ConfigError,
    ConvertConfig,
    ExportConfig,
    FinetuneConfig,
    KnnConfig,
    LinprobeConfig,
    PretrainConfig,
    ShardConfig,
    StatsConfig,
    VisualizeConfig,
    check_config,
)
from mae.errors import DataError
from mae.run_folder import error_log
from mae.train.loop import TrainingError
from mae.weights.importers import CheckpointError

# Each config field's docstring is its --help text.
set_parsing_settings(docstring_parse_attribute_docstrings=True)

STAGES: dict[str, tuple[type, str]] = {
    "pretrain": (PretrainConfig, "Pretrain a ViT encoder by masked autoencoding."),
    "linprobe": (LinprobeConfig, "Train a linear classifier on the frozen encoder's features."),
    "finetune": (FinetuneConfig, "Fine-tune the whole ViT with a fresh classifier head."),
    "knn": (KnnConfig, "Weighted k-NN classification with the frozen encoder's features."),
    "visualize": (VisualizeConfig, "Write original | masked | reconstruction grids for some images."),
    "export": (ExportConfig, "Write the encoder as safetensors with timm key names."),
    "stats": (StatsConfig, "Print the per-channel mean and std of a data set (what --data.mean auto measures)."),
    "convert": (ConvertConfig, "Convert another toolkit's MAE checkpoint to this project's safetensors."),
    "shard": (ShardConfig, "Write images as WebDataset tar shards with an index (a --data.path for every stage)."),
}


def build_parser(stage: str) -> ArgumentParser:
    config_cls, description = STAGES[stage]
    parser = ArgumentParser(prog=f"mae {stage}", description=description, exit_on_error=False, default_meta=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe YAML (sparse: only what differs).")
    # A list of files reads best as `--images a.jpg b.jpg`, which needs argparse's nargs.
    lists = {"images"} if stage == "visualize" else set()
    positional = {"source"} if stage in ("convert", "shard") else set()
    flags = {"attention"} if stage == "visualize" else set()  # `--attention` alone reads best
    parser.add_class_arguments(config_cls, fail_untyped=True, sub_configs=True, skip=lists | positional | flags)
    for name in flags:
        parser.add_argument(f"--{name}", action=ActionYesNo, default=False, help="Show attention maps.")
    for name in lists:
        parser.add_argument(f"--{name}", nargs="+", type=str, required=True, help="Image files.")
    for name in positional:
        what = "The images to shard (what --data.path reads)." if stage == "shard" else "The checkpoint to convert."
        parser.add_argument(name, type=str, help=what)
    return parser


def parse(stage: str, argv: list[str]) -> Any:
    """Parse a stage's options into its frozen config dataclass."""
    parser = build_parser(stage)
    ns = parser.parse_args(argv)
    demo = stage == "pretrain" and ns.data.path is None
    if demo:
        parser.set_defaults(DEMO_OVERRIDES)
        ns = parser.parse_args(argv)
    ns = parser.instantiate(ns) if hasattr(parser, "instantiate") else parser.instantiate_classes(ns)
    config_cls = STAGES[stage][0]
    cfg = config_cls(**{f.name: ns[f.name] for f in fields(config_cls)})
    check_config(cfg)
    if demo:
        print(
            "mae pretrain: no --data.path given: training on the built-in demo photos (scikit-image)", file=sys.stderr
        )
    return cfg


def _one_line(message: object) -> str:
    if "Original Traceback" in str(message):  # re-raised from a DataLoader worker: its cause, not its traceback
        return _cause(message)
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    # argparse names a missing option by its destination ("required: output"); users type "--output".
    return re.sub(
        r"(arguments are required: )(.*)$",
        lambda m: m.group(1) + ", ".join(f"--{a}" if a != "source" else a for a in m.group(2).split(", ")),
        text,
    )


def _cause(e: BaseException) -> str:
    """One line naming what failed: for an error re-raised from a DataLoader worker, the original
    exception's last line, not the whole worker traceback."""
    text = str(e)
    if "Original Traceback" in text:
        last = [line.strip() for line in text.splitlines() if line.strip()][-1]
        return f"{last} (in a DataLoader worker)"
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


def run_stage(stage: str, cfg: Any) -> None:
    if stage == "pretrain":
        from mae.train.stages import run_pretrain

        run_pretrain(cfg)
    elif stage in ("linprobe", "finetune", "knn"):
        from mae.train import downstream

        getattr(downstream, f"run_{stage}")(cfg)
    elif stage == "visualize":
        from mae.train.stages import run_visualize

        run_visualize(cfg)
    elif stage == "export":
        from mae.weights.export import export_encoder

        path = export_encoder(cfg.checkpoint, cfg.output, format=cfg.format)
        print(f"wrote {path}")
    elif stage == "stats":
        from mae.data.open import open_source
        from mae.data.stats import channel_stats

        source = open_source(cfg.data.path, image_column=cfg.data.image_column)
        mean, std = channel_stats(source, cfg.model.in_chans, samples=cfg.samples, seed=cfg.seed)
        print(f"{len(source)} images, {min(cfg.samples, len(source))} measured (seed {cfg.seed}), pixels in [0, 1]")
        print(f"mean {mean}\nstd  {std}")
        print(f"--data.mean '{mean}' --data.std '{std}'")
    elif stage == "shard":
        shard(cfg)
    elif stage == "convert":
        from mae.weights.export import export_encoder, save_model
        from mae.weights.importers import load_pretrained

        heads = {k: v for k, v in (("num_heads", cfg.num_heads), ("decoder_num_heads", cfg.decoder_num_heads)) if v}
        model = load_pretrained(cfg.source, **heads)
        path = export_encoder(model, cfg.output) if cfg.encoder_only else save_model(model, cfg.output)
        print(f"wrote {path}")


def shard(cfg: ShardConfig) -> Path:
    """`mae shard`: open `cfg.source` as --data.path would (labeled when asked, or when it can be), write it."""
    import json
    from dataclasses import asdict

    from mae.data.open import open_source
    from mae.data.shard_writer import write_shards

    source = open_source(
        cfg.source, labeled=cfg.labeled, image_column=cfg.image_column, label_column=cfg.label_column, option="source"
    )
    classes = getattr(source, "classes", None)
    what = f"{len(source)} images" + (f" in {len(classes)} classes" if classes is not None else "")
    print(f"mae shard: {what} from {cfg.source} -> {cfg.output}", flush=True)
    options = {k: v for k, v in asdict(cfg).items() if k != "output"}
    index = write_shards(
        source,
        cfg.output,
        samples_per_shard=cfg.samples_per_shard,
        max_size=cfg.max_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        options=options,
    )
    shards = json.loads(index.read_text())["shardlist"]
    size = sum(s["filesize"] for s in shards) / 2**20
    print(f"wrote {len(shards)} shards ({size:.1f} MiB) and {index}; use --data.path {cfg.output}")
    return index


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        usage = "usage: mae {" + ",".join(STAGES) + "} [--config RECIPE.yaml] [--section.key VALUE ...]"
        lines = [usage, ""] + [f"  {name:<10} {desc}" for name, (_, desc) in STAGES.items()]
        if argv and argv[0] not in ("-h", "--help"):
            print(f"mae: error: unknown stage '{argv[0]}'; choose one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        print("\n".join(lines + ["", "mae <stage> --help lists every option."]))
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    import multiprocessing.util  # noqa: F401 - its exit handler must be registered before ours

    atexit.register(_end_worker_processes)
    cfg = None
    try:
        cfg = parse(stage, rest)
        run_stage(stage, cfg)
    except (argparse.ArgumentError, ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        print(f"mae {stage}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"mae {stage}: stopped: {_one_line(e)}", file=sys.stderr)
        return 1
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
