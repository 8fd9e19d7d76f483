"""`mae anomaly`'s reading and writing: images read whole at the model's size, the masks of the anomalous pixels
that judge the maps, and what the main process writes (scores.csv, metrics.json, roc.png, maps/,
most_anomalous.png)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mae.anomaly_maps import roc_curve
from mae.config import AnomalyConfig, ConfigError
from mae.data.labeled import LabeledSamples, Subset
from mae.data.transforms import normalize, resized_crop
from mae.run_folder import ANOMALY_METRICS, MAPS, MOST_ANOMALOUS, ROC, SCORES


class Positions(Subset):
    """Every row of a source, labeled by its own position: `predict` hands the positions back beside the outputs,
    so each result finds its file whatever was unreadable and whatever the processes."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.indices = self.labels = np.arange(len(source))
        self.classes = []


def input_transform(size: tuple[int, int], mean: tuple, std: tuple):
    """An image (PIL, or a float tensor [C, H, W] in [0, 1]) resized whole to the model's `size` (no crop, so a
    map lies over the whole image) and normalised."""
    from torchvision.transforms.v2 import functional as F

    def transform(img: Any) -> torch.Tensor:
        x = img if isinstance(img, torch.Tensor) else F.pil_to_tensor(img)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        x = resized_crop(x, 0, 0, x.shape[-2], x.shape[-1], size)
        return normalize(x[None], mean, std)[0]

    return transform


def samples(source: Any, size: tuple[int, int], mean: tuple, std: tuple, in_chans: int) -> LabeledSamples:
    return LabeledSamples(Positions(source), input_transform(size, mean, std), in_chans=in_chans)


def ground_truth(source: Any, positions: np.ndarray, size: tuple[int, int], mask_path: str | None):
    """(rows, masks [M, H, W] bool) in MVTec AD's layout, `<mask_path>/<defect>/<name>_mask.png` for the image
    `<defect>/<name>.<ext>` (`mask_path` null: `ground_truth/` beside the image's class folder's parent, as in
    MVTec AD), resized as the images are: rows with a mask file, and the normal rows (class good/normal: all zero).
    None where no mask file exists."""
    from PIL import Image

    if mask_path is not None and not Path(mask_path).is_dir():
        raise ConfigError(f"--mask_path {mask_path}: no such folder; give the folder of <defect>/<name>_mask.png files")
    classes = list(getattr(source, "classes", None) or [])
    rows, masks, found = [], [], False
    for row, pos in enumerate(positions):
        path = Path(source.name(int(pos)))
        root = Path(mask_path) if mask_path is not None else path.parent.parent.parent / "ground_truth"
        file = root / path.parent.name / f"{path.stem}_mask.png"
        if file.is_file():
            found = True
            m = torch.from_numpy(np.asarray(Image.open(file).convert("L"), dtype=np.float32))[None, None]
            masks.append(torch.nn.functional.interpolate(m, size=list(size), mode="nearest")[0, 0] > 127)
            rows.append(row)
        elif classes and classes[source.labels[pos]] in ("good", "normal"):
            masks.append(torch.zeros(size, dtype=torch.bool))
            rows.append(row)
    if mask_path is not None and not found:
        raise ConfigError(f"--mask_path {mask_path}: holds no <defect>/<name>_mask.png for the images of --data.path")
    return (torch.tensor(rows), torch.stack(masks).numpy()) if found else None


def map_name(name: str, root: Any) -> str:
    """A file name for an image's map: its path below --data.path (or its source name), without extension,
    folders joined by `__`."""
    if isinstance(root, str) and root and name.startswith(str(Path(root))):  # not a datasets.Dataset object
        name = name[len(str(Path(root))) :].lstrip("/")
    stem = re.sub(r"\.[A-Za-z0-9]+$", "", name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace("/", "__")).strip("_") or "image"


class Writer:
    """What the main process writes: scores.csv, metrics.json, roc.png, maps/, most_anomalous.png."""

    def __init__(self, cfg: AnomalyConfig, source: Any, positions: np.ndarray, reading: tuple) -> None:
        self.cfg, self.source, self.positions = cfg, source, positions
        self.out = Path(cfg.output_dir)
        self.names = [source.name(int(p)) for p in positions]
        self.reading = reading  # (size, mean, std, in_chans): how the images are read again for figures

    def scores(self, scores: dict[str, torch.Tensor], anomalous: np.ndarray | None) -> None:
        ranks = {k: _ranks(v) for k, v in scores.items()}
        single = len(scores) == 1
        header = ["file"] + [c for k in scores for c in (["score", "rank"] if single else [f"{k}_score", f"{k}_rank"])]
        classes = list(getattr(self.source, "classes", None) or [])
        header += (["class"] if classes else []) + (["anomalous"] if anomalous is not None else [])
        first = next(iter(ranks.values()))
        with (self.out / SCORES).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            for row in np.argsort(first, kind="stable"):
                cells = [self.names[row]]
                for k, s in scores.items():
                    cells += [f"{s[row].item():.6g}", int(ranks[k][row])]
                cells += [classes[self.source.labels[self.positions[row]]]] if classes else []
                cells += [int(anomalous[row])] if anomalous is not None else []
                w.writerow(cells)

    def metrics(self, metrics: dict[str, Any], scores: dict[str, torch.Tensor], anomalous: np.ndarray | None) -> None:
        cfg = self.cfg
        settings = {"score": cfg.score, "masks": cfg.masks, "aggregate": cfg.aggregate, "top_percent": cfg.top_percent,
                    "k": cfg.k, "shrinkage": cfg.shrinkage, "features": cfg.features, "blur": cfg.blur,
                    "seed": cfg.seed}  # fmt: skip
        (self.out / ANOMALY_METRICS).write_text(json.dumps({**metrics, **settings}, indent=1))
        if anomalous is not None and "auroc" in metrics:
            from mae.figures import roc_figure

            name, s = next(iter(scores.items()))
            fpr, tpr = roc_curve(s.numpy(), anomalous)
            roc_figure(fpr, tpr, self.out / ROC, f"{name}: AUROC {metrics['auroc']:.3f}, AUPR {metrics['aupr']:.3f}")

    def images(self, rows) -> torch.Tensor:
        """The images at `rows`, read again as the model saw them, as RGB in [0, 1] [n, 3, H, W]."""
        from mae.data.transforms import denormalize
        from mae.figures import as_rgb

        size, mean, std, in_chans = self.reading
        ds = samples(self.source, size, mean, std, in_chans)
        x = torch.stack([ds[int(self.positions[r])]["image"] for r in rows])
        return as_rgb(denormalize(x, mean, std))

    def maps(self, maps: torch.Tensor, scores: torch.Tensor) -> None:
        """maps/<name>.npy and .png (on one scale for all: the 99.9th percentile of every map's pixels), and the
        most anomalous images with their maps."""
        from torchvision.utils import make_grid

        from mae.figures import enlarge, heat_colour, heat_overlay, save_grid

        sample = maps.flatten()[torch.randperm(maps.numel(), generator=torch.Generator().manual_seed(0))[: 10**6]]
        top = sample.quantile(0.999).clamp_min(1e-12)
        heat = (maps / top).clamp(0, 1).unsqueeze(1)  # [N, 1, H, W]
        if self.cfg.save_maps:
            folder = self.out / MAPS
            folder.mkdir(parents=True, exist_ok=True)
            for start in range(0, len(maps), 256):
                rows = range(start, min(start + 256, len(maps)))
                overlays = heat_overlay(self.images(rows), heat[start : rows.stop])
                for r, overlay in zip(rows, overlays, strict=True):
                    name = map_name(self.names[r], self.cfg.data.path)
                    np.save(folder / f"{name}.npy", maps[r].numpy())
                    save_grid(overlay, folder / f"{name}.png")
        worst = torch.argsort(scores, descending=True, stable=True)[: self.cfg.figure_images].tolist()
        original = self.images(worst)
        rows = torch.stack([original, heat_overlay(original, heat[worst]), heat_colour(heat[worst])], 1)
        # small images (28-px) enlarged to at least 128 px a side, as in the reconstruction previews
        figure = make_grid(enlarge(rows.flatten(0, 1)), nrow=3, padding=2, pad_value=1.0)
        save_grid(figure, self.out / MOST_ANOMALOUS)


def _ranks(scores: torch.Tensor) -> np.ndarray:
    """1 = the highest score (ties in file order)."""
    order = torch.argsort(scores, descending=True, stable=True).numpy()
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(1, len(order) + 1)
    return ranks
