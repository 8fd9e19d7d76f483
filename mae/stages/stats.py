"""`mae stats`: the per-channel mean and std of a data set (what `--data.mean auto` measures)."""

from __future__ import annotations

from mae.config import StatsConfig
from mae.data.open import open_source
from mae.data.stats import channel_stats, stored_channels
from mae.stages.registry import StageResult, register_stage


@register_stage(
    "stats", StatsConfig, "Print the per-channel mean and std of a data set (what --data.mean auto measures)."
)
def run_stats(cfg: StatsConfig) -> StageResult:
    source = open_source(cfg.data.path, image_column=cfg.data.image_column)
    in_chans = cfg.model.in_chans or stored_channels(source)
    mean, std = channel_stats(source, in_chans, samples=cfg.samples, seed=cfg.seed)
    measured = min(cfg.samples, len(source))
    print(f"{len(source)} images, {in_chans} channels, {measured} measured (seed {cfg.seed}), pixels in [0, 1]")
    print(f"mean {mean}\nstd  {std}")
    print(f"--data.mean '{mean}' --data.std '{std}'")
    return StageResult(metrics={"mean": mean, "std": std, "images": len(source), "in_chans": in_chans})
