"""The stages, one module each, registered in `mae.stages.registry` as they are imported (in this order, which
is the order `mae --help` lists them)."""

from mae.stages import pretrain, linprobe, finetune, knn, visualize, export, stats, convert, shard  # noqa: F401, I001
from mae.stages import predict, anomaly, segment  # noqa: F401, I001 - importing registers them, in this order
from mae.stages.registry import Stage, StageResult, get_stage, list_stages, register_stage, unregister_stage

__all__ = ["Stage", "StageResult", "get_stage", "list_stages", "register_stage", "unregister_stage"]
