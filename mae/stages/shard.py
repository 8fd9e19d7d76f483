"""`mae shard`: images written as WebDataset tar shards with an index, a `--data.path` for every stage."""

from __future__ import annotations

import json
from pathlib import Path

from mae.config import ShardConfig
from mae.data.open import open_source, recorded_path
from mae.data.shard_writer import write_shards
from mae.stages.registry import StageResult, register_stage
from mae.train.checkpoint import config_record


@register_stage(
    "shard",
    ShardConfig,
    "Write images as WebDataset tar shards with an index (a --data.path for every stage).",
    positional={"source": "The images to shard (what --data.path reads)."},
)
def run_shard(cfg: ShardConfig) -> StageResult:
    """Open `cfg.source` as --data.path would (labeled when asked, or when it can be), write it as shards."""
    source = open_source(
        cfg.source, labeled=cfg.labeled, image_column=cfg.image_column, label_column=cfg.label_column, option="source"
    )
    classes = getattr(source, "classes", None)
    what = f"{len(source)} images" + (f" in {len(classes)} classes" if classes is not None else "")
    print(f"mae shard: {what} from {recorded_path(cfg.source)} -> {cfg.output}", flush=True)
    options = {k: v for k, v in config_record(cfg).items() if k != "output"}
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
    return StageResult(output_dir=Path(cfg.output), export=index)
