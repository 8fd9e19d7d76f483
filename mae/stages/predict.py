"""`mae predict`: the top-k classes and probabilities of a trained classifier (`mae.load_classifier`) for image
files or any image source, printed or written as CSV or JSON."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from mae.config import ConfigError, PredictConfig
from mae.data.folder import FolderSource
from mae.data.images import IMAGE_EXTENSIONS
from mae.data.open import open_source
from mae.data.transforms import collate_images, decode_side, load_image
from mae.errors import CheckpointError
from mae.stages.registry import StageResult, register_stage
from mae.weights.classifier import Classifier, load_classifier
from mae.weights.segmenter import segmenter_file


@register_stage(
    "predict",
    PredictConfig,
    "Classify images with a trained classifier (top-k classes) or segment them with a segmenter (mask PNGs).",
    lists={"images": "Image files (or folders of images) to classify; or give --data.path."},
)
def run_predict(cfg: PredictConfig) -> StageResult:
    """Every image's top-k classes; the table goes to --output (.csv / .json) or is printed. A segmenter's masks go
    to --output_dir (`mae.stages.segment_predict`)."""
    check(cfg)
    if segmenter_file(cfg.pretrained) is not None:
        from mae.stages.segment_predict import predict_masks

        return predict_masks(cfg, images_source)
    try:
        classifier = load_classifier(cfg.pretrained)
    except CheckpointError as e:
        raise ConfigError(f"--pretrained {cfg.pretrained}: {e}") from None
    source = images_source(cfg)
    rows = predict_source(classifier, source, top_k=cfg.top_k, batch_size=cfg.loop.batch_size,
                          num_workers=cfg.data.num_workers)  # fmt: skip
    if cfg.output:
        write_predictions(rows, Path(cfg.output))
        print(f"wrote {len(rows)} predictions to {cfg.output}")
    else:
        for row in rows:  # the same columns as the CSV: file, then each of the top-k classes and its probability
            print("\t".join([row["file"], *(f"{c}\t{p:.4f}" for c, p in row["top_k"])]))
    return StageResult(export=Path(cfg.output) if cfg.output else None, metrics={"images": len(rows)})


def check(cfg: PredictConfig) -> None:
    if not cfg.pretrained:
        raise ConfigError(
            "--pretrained: required: a linprobe, finetune or segment output folder, or its classifier.safetensors / "
            "segmenter.safetensors"
        )
    if not Path(cfg.pretrained).exists():
        raise ConfigError(f"--pretrained {cfg.pretrained}: no such file or folder")
    if bool(cfg.images) == bool(cfg.data.path):
        raise ConfigError("--images / --data.path: give exactly one: image files, or a source such as an image folder")
    if cfg.output and Path(cfg.output).suffix.lower() not in (".csv", ".json"):
        raise ConfigError(f"--output {cfg.output}: write predictions to a .csv or a .json file")


def images_source(cfg: PredictConfig) -> Any:
    """The images to classify as one source: --data.path through `open_source` (unlabeled; a labeled folder is an
    image folder too), or the --images files (a folder among them gives its images)."""
    if cfg.data.path:
        return open_source(cfg.data.path, labeled=False, image_column=cfg.data.image_column)
    paths: list[str] = []
    for item in cfg.images:
        p = Path(item)
        if p.is_dir():
            paths += [str(x) for x in open_source(item, labeled=False, option="--images").paths]
        elif p.is_file():
            if p.suffix.lower() not in IMAGE_EXTENSIONS:
                raise ConfigError(f"--images {item}: not an image file ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            paths.append(item)
        else:
            raise ConfigError(f"--images {item}: no such file or folder")
    return FolderSource(Path("."), paths=paths, option="--images")


class _Images(torch.utils.data.Dataset):
    """Source images through the classifier's eval transform: {"image", "index"}, or {"bad": (name, reason)}."""

    def __init__(self, source: Any, classifier: Classifier) -> None:
        self.source, self.transform = source, classifier.transform
        cfg = classifier.model.pretrained_cfg
        self.in_chans = cfg["input_size"][0]
        # As the training stages' evaluation decodes them (`labeled_eval_loader`), so the same pixels come out.
        source.set_decode_size(decode_side(tuple(cfg["input_size"][1:]), cfg["crop_pct"]))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        img, bad = load_image(self.source, i, self.in_chans)
        return bad if bad is not None else {"image": self.transform(img), "index": i}


@torch.no_grad()
def predict_source(
    classifier: Classifier, source: Any, *, top_k: int = 5, batch_size: int = 64, num_workers: int = 0
) -> list[dict[str, Any]]:
    """One row per readable image, in the source's order: {"file", "class", "probability", "top_k": [(class,
    probability), ...]}; unreadable files are warned about and left out."""
    model = classifier.model.eval()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    k = min(top_k, len(classifier.classes))
    loader = torch.utils.data.DataLoader(
        _Images(source, classifier), batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images
    )
    rows = []
    for batch in loader:
        for name, reason in batch["bad"]:
            warnings.warn(f"{name}: skipped, cannot be read ({reason})", stacklevel=2)
        if batch["image"] is None:
            continue
        probs = model(batch["image"].to(device)).float().softmax(1).cpu()
        top = probs.topk(k, dim=1)
        for i, values, labels in zip(batch["index"].tolist(), top.values.tolist(), top.indices.tolist(), strict=True):
            ranked = [(classifier.classes[c], p) for c, p in zip(labels, values, strict=True)]
            rows.append({"file": source.name(i), "class": ranked[0][0], "probability": ranked[0][1], "top_k": ranked})
    if not rows:
        raise ConfigError("no image could be read; check the files (mae predict warned about each)")
    return rows


def write_predictions(rows: list[dict[str, Any]], path: Path) -> None:
    """A .csv (file, class, probability, class_2, probability_2, ...) or a .json list of the rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        out = [{**r, "top_k": [{"class": c, "probability": p} for c, p in r["top_k"]]} for r in rows]
        path.write_text(json.dumps(out, indent=1) + "\n")
        return
    k = max(len(r["top_k"]) for r in rows)
    header = ["file", "class", "probability"] + [f"{c}_{j}" for j in range(2, k + 1) for c in ("class", "probability")]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in rows:
            writer.writerow([r["file"], *(x for pair in r["top_k"] for x in pair)])
