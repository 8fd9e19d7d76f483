"""Typed, frozen configuration: the single source of truth for every stage.

Defaults are the paper's recipe (He et al., 2021, Table 8). A recipe YAML states only what differs; the command
line overrides it with dotted keys. Derived values (effective batch, absolute learning rate) are computed where
used and logged, never written back.

Each stage's config is composed of the sections it reads, and nothing else (`mae <stage> --help` lists only
options that change what the stage does; a key it does not read is refused, as a typo is). Fields shared by
several sections are defined once, in `sections`, and inherited. Each field carries its own constraint (`ranged` /
`ruled`, in `fields`), checked by `check_config` as soon as the options are parsed; the docstring under each
field is its `--help` text.
"""

from mae.config.downstream import (
    LARS_MIN_BATCH,
    AugmentConfig,
    FinetuneConfig,
    FinetuneModelConfig,
    FinetuneOptimConfig,
    KnnConfig,
    LabeledDataConfig,
    LinprobeConfig,
    ProbeModelConfig,
    ProbeOptimConfig,
)
from mae.config.fields import IMAGENET_MEAN, IMAGENET_STD, Rule, check_config, flatten, ranged, ruled, to_dict
from mae.config.inference import AnomalyConfig, AnomalyDataConfig, PredictConfig, PredictDataConfig
from mae.config.pretrain import DEMO_OVERRIDES, DataConfig, ModelConfig, MonitorConfig, OptimConfig, PretrainConfig
from mae.config.sections import (
    AdamWConfig,
    BatchLoopConfig,
    ColumnsConfig,
    EncodeLoopConfig,
    ImageColumnConfig,
    LabeledSourceConfig,
    LoopConfig,
    NormalisationConfig,
    PathConfig,
    PrecisionLoopConfig,
    PretrainedConfig,
    RunConfig,
    ScheduleConfig,
    SourceConfig,
    TrainingConfig,
    WorkersConfig,
)
from mae.config.segment import SegmentAugConfig, SegmentConfig, SegmentDataConfig, SegmentModelConfig
from mae.config.tools import ConvertConfig, ExportConfig, ShardConfig, StatsConfig, StatsModelConfig, VisualizeConfig
from mae.errors import ConfigError

__all__ = [
    "AdamWConfig", "AnomalyConfig", "AnomalyDataConfig", "AugmentConfig", "BatchLoopConfig", "ColumnsConfig",
    "ConfigError", "ConvertConfig", "DEMO_OVERRIDES", "DataConfig", "EncodeLoopConfig", "ExportConfig",
    "FinetuneConfig", "FinetuneModelConfig", "FinetuneOptimConfig", "IMAGENET_MEAN", "IMAGENET_STD",
    "ImageColumnConfig", "KnnConfig", "LARS_MIN_BATCH", "LabeledDataConfig", "LabeledSourceConfig", "LinprobeConfig",
    "LoopConfig", "ModelConfig", "MonitorConfig", "NormalisationConfig", "OptimConfig", "PathConfig",
    "PrecisionLoopConfig", "PredictConfig", "PredictDataConfig", "PretrainConfig", "PretrainedConfig",
    "ProbeModelConfig", "ProbeOptimConfig", "Rule", "RunConfig", "ScheduleConfig", "SegmentAugConfig", "SegmentConfig",
    "SegmentDataConfig", "SegmentModelConfig", "ShardConfig", "SourceConfig", "StatsConfig", "StatsModelConfig",
    "TrainingConfig", "VisualizeConfig", "WorkersConfig", "check_config", "flatten", "ranged", "ruled", "to_dict",
]  # fmt: skip
