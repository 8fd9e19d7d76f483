"""The configuration of the stages that run a trained model over images: `mae predict` (a classifier's classes)
and `mae anomaly` (an MAE's anomaly scores)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mae.config.fields import ranged
from mae.config.sections import (
    BatchLoopConfig,
    LabeledSourceConfig,
    NormalisationConfig,
    PrecisionLoopConfig,
    PretrainedConfig,
    RunConfig,
    SourceConfig,
    WorkersConfig,
)


@dataclass(frozen=True)
class PredictDataConfig(WorkersConfig, SourceConfig):
    """Images to classify, as one source."""

    path: str | None = None
    """Any image source mae reads (an image folder, labeled or not, a `save_to_disk` folder, hf:NAME[:split], tar
    shards); instead of --images."""


@dataclass(frozen=True)
class PredictConfig:
    """mae predict."""

    pretrained: str | None = None
    """A classifier (a linprobe or finetune output folder, its classifier.safetensors, or an hf folder of one), or a
    segmenter (a segment output folder or its segmenter.safetensors)."""
    images: list[str] | None = None
    """Image files (or folders of images) to classify; or give --data.path."""
    data: PredictDataConfig = field(default_factory=PredictDataConfig)
    loop: BatchLoopConfig = field(default_factory=BatchLoopConfig)
    top_k: int = ranged(5, ge=1)
    """How many classes (and probabilities) per image, most probable first (at most the class count)."""
    output: str | None = None
    """Where the predictions go: a .csv (columns file, class, probability, then class_2, probability_2, ...) or a
    .json file; null prints them."""
    output_dir: str | None = None
    """Where a segmenter's masks go: OUTPUT_DIR/<name>.png per image (a `datasets` row: its index, 000012.png; a
    palette PNG of class indices), classes.json and overlay.png; null = outputs/predict. A classifier's predictions
    go to --output."""


@dataclass(frozen=True)
class AnomalyDataConfig(WorkersConfig, NormalisationConfig, LabeledSourceConfig):
    """The images to score."""

    path: str | None = None
    """Images to score: a folder (any nesting; class subfolders give labels), a `save_to_disk` folder, hf:NAME[:split]
    or tar shards; null = demo images. With a class `normal` or `good` (MVTec AD's test/good), or --normal, image
    AUROC and AUPR are reported; masks of the anomalous pixels (--mask_path, MVTec's ground_truth/ beside test/ by
    default) give pixel AUROC and PRO."""


@dataclass(frozen=True)
class AnomalyConfig(PretrainedConfig, RunConfig):
    """mae anomaly."""

    data: AnomalyDataConfig = field(default_factory=AnomalyDataConfig)
    loop: PrecisionLoopConfig = field(default_factory=PrecisionLoopConfig)
    score: Literal["recon", "knn", "gaussian", "both", "all"] | None = None
    """null: chosen from what is known, said in the first line and metrics.json: with the normal training images
    (--train_path, or the run's recorded data.path) gaussian with --features positions, else recon. recon: the MAE's
    reconstruction error (maps); knn: the encoder features' distance to the nearest training images; gaussian: their
    Mahalanobis distance to a Gaussian fitted to the training images' features; both: recon and knn; all: the three
    (docs/anomaly.md: which when)."""
    masks: int = ranged(4, ge=2)
    """Complementary mask sets per image: each masks 1 - 1/K of the patches, every patch masked K - 1 times."""
    features: Literal["masked", "full", "positions"] | None = None
    """null: positions for the chosen score (no --score), masked otherwise. --score knn/gaussian/both/all: the
    encoder's patch tokens averaged over the visible patches of each of the --masks sets, as in pretraining, then over
    the sets (masked), or over the whole image (full: for an encoder not pretrained by masking); --score gaussian
    also: the whole image's tokens one per patch position, each judged by a Gaussian of its own position, the
    distances averaged (positions: PaDiM's model, docs/anomaly.md: how it scores; without recon, the maps are the
    patches' distances upsampled; memory: patches x width floats per training image)."""
    blur: float = ranged(0.0, ge=0)
    """--features positions maps: the standard deviation, in pixels, of a Gaussian blur after the bilinear upsampling
    of the patches' distances (0 = none; PatchCore uses 4 at 224 px)."""
    aggregate: Literal["topk_mean", "mean", "max"] = "topk_mean"
    """An image's reconstruction score from its map: the mean of its top --top_percent pixels, the mean, or the max."""
    top_percent: float = ranged(1.0, gt=0, le=100)
    """With --aggregate topk_mean: the share of the map's pixels (in percent) whose mean is the score."""
    train_path: str | None = None
    """The normal training images (any source) for the feature scores; null = the run's own recorded data.path."""
    mask_path: str | None = None
    """Masks of the anomalous pixels, MVTec AD's layout: <defect>/<name>_mask.png for --data.path's <defect>/<name>
    (images of the normal class: all normal); null = ground_truth/ beside --data.path's folder where it exists."""
    k: int = ranged(5, ge=1)
    """--score knn/both/all: the nearest training images whose mean cosine distance is the score."""
    shrinkage: float = ranged(1e-3, gt=0)
    """--score gaussian/all: the Gaussian's covariance plus this times its mean variance on the diagonal."""
    normal: str | None = None
    """The class of --data.path that is normal (the others are anomalies); null = a class named normal or good."""
    save_maps: bool = True
    """Write maps/<name>.npy (the map at the model's input resolution) and maps/<name>.png (an overlay)."""
    figure_images: int = ranged(8, ge=1)
    """How many of the most anomalous images most_anomalous.png shows."""
