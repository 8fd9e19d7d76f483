"""`mae predict` with a segmenter: one mask PNG per image (palette mode, pixel value = class index), the class
names beside them and an overlay figure of the first images. The images go through the segmenter as `mae segment`
evaluated them: each at its own size, a window slid over it (`Segmenter.segment`), batched alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from mae.config import ConfigError, PredictConfig
from mae.data.folder import FolderSource
from mae.data.hf import HFSource
from mae.data.open import dataset_named, is_dataset
from mae.data.segmentation import IMAGES, is_segmentation_folder
from mae.data.segmentation_hf import image_column_to_segment
from mae.data.transforms import load_image
from mae.errors import CheckpointError
from mae.figures import as_rgb
from mae.run_folder import CLASSES, OVERLAY
from mae.stages.registry import StageResult
from mae.train.segment_task import same_size_groups
from mae.weights.segmenter import LoadedSegmenter, load_segmenter, model_input

OVERLAY_IMAGES = 8  # images the overlay figure shows, in the source's order


def predict_masks(cfg: PredictConfig, images_source: Callable[[PredictConfig], Any]) -> StageResult:
    """Segment every image of --data.path (a segmentation folder's images/) or --images (`images_source(cfg)`, the
    images any predict reads) into --output_dir."""
    if not cfg.output_dir:
        raise ConfigError("--output_dir: required with a segmenter: the folder its mask PNGs go to")
    if cfg.output:
        raise ConfigError(f"--output {cfg.output}: a segmenter writes mask PNGs to --output_dir, not a table")
    try:
        seg = load_segmenter(cfg.pretrained)
    except CheckpointError as e:
        raise ConfigError(f"--pretrained {cfg.pretrained}: {e}") from None
    if cfg.data.path and is_segmentation_folder(cfg.data.path):
        source = FolderSource(Path(cfg.data.path) / IMAGES)
    else:
        if cfg.data.path and cfg.data.image_column is None and is_dataset(cfg.data.path):
            # a dataset may list its masks first: its images are the column beside them
            features = dataset_named(cfg.data.path, "--data.path").features
            column = image_column_to_segment(features, None, "--data.path")
            cfg = replace(cfg, data=replace(cfg.data, image_column=column))
        source = images_source(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written, shown = segment_source(seg, source, out, batch_size=cfg.loop.batch_size, num_workers=cfg.data.num_workers)
    (out / CLASSES).write_text(json.dumps(seg.classes))
    overlay_figure(shown, seg.palette, out / OVERLAY)
    print(f"wrote {len(written)} masks, {CLASSES} and {OVERLAY} to {out}")
    return StageResult(output_dir=out, metrics={"images": len(written)})


class _Images(torch.utils.data.Dataset):
    """{"image": normalised [C, H, W], "mask": None, "index"}, or {"bad": (name, reason)}."""

    def __init__(self, source: Any, seg: LoadedSegmenter) -> None:
        self.source, self.transform, self.in_chans = source, seg.transform, model_input(seg.model)[0]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        img, bad = load_image(self.source, i, self.in_chans)
        return bad if bad is not None else {"image": self.transform(img), "mask": torch.zeros(()), "index": i}


def _collate(samples: list[dict]) -> dict:
    good = [s for s in samples if "bad" not in s]
    return {"image": [s["image"] for s in good], "mask": [s["mask"] for s in good],
            "index": [s["index"] for s in good], "bad": [s["bad"] for s in samples if "bad" in s]}  # fmt: skip


def mask_name(source: Any, i: int) -> Path:
    """Where image `i`'s mask goes under the output folder: its path below the source's root, as .png; a `datasets`
    row's, its row index (six digits or more)."""
    if isinstance(source, HFSource):  # "NAME[i]" is no file name: a dot in NAME would be taken for a suffix
        return Path(f"{i:06d}.png")
    name = Path(source.name(i))
    root = getattr(source, "root", None)
    if root is not None and name.is_relative_to(root) and Path(root) != Path("."):
        return name.relative_to(root).with_suffix(".png")
    return Path(name.name).with_suffix(".png")


@torch.no_grad()
def segment_source(seg: LoadedSegmenter, source: Any, out: Path, *, batch_size: int, num_workers: int = 0):
    """Write out/<name>.png for every readable image; returns (the paths written, the first images with their
    masks for the overlay)."""
    import warnings

    model = seg.model.eval()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    flat = [v for colour in seg.palette for v in colour]
    loader = torch.utils.data.DataLoader(_Images(source, seg), batch_size=batch_size, num_workers=num_workers,
                                         collate_fn=_collate)  # fmt: skip
    written, shown = [], []
    for batch in loader:
        for name, reason in batch["bad"]:
            warnings.warn(f"{name}: skipped, cannot be read ({reason})", stacklevel=2)
        indices = iter(batch["index"])
        for images, _ in same_size_groups(batch["image"], batch["mask"]):
            pred = model.segment(images.to(device)).argmax(1).to(torch.uint8).cpu()
            for image, mask in zip(images, pred, strict=True):
                path = out / mask_name(source, next(indices))
                path.parent.mkdir(parents=True, exist_ok=True)
                png = Image.frombytes("P", (mask.shape[1], mask.shape[0]), mask.numpy().tobytes())
                png.putpalette(flat)
                png.save(path)
                written.append(path)
                if len(shown) < OVERLAY_IMAGES:
                    shown.append((seg.transform, image, mask))
    if not written:
        raise ConfigError("no image could be read; check the files (mae predict warned about each)")
    return written, shown


def overlay_figure(shown: list, palette: list[list[int]], path: Path, side: int = 160) -> Path:
    """Rows of (image, image with its mask's colours blended in at half strength), each scaled to `side` px high."""
    tiles = []
    for transform, image, mask in shown:
        x = as_rgb((image * transform.std + transform.mean)[None].clamp(0, 1))[0]
        picture = Image.fromarray((x.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
        colours = torch.tensor(palette, dtype=torch.uint8)[mask.long()].numpy()
        blended = Image.blend(picture, Image.fromarray(colours), 0.5)
        width = max(1, round(picture.width * side / picture.height))
        tiles.append([im.resize((width, side), Image.NEAREST) for im in (picture, blended)])
    width = max(t[0].width for t in tiles) * 2
    figure = Image.new("RGB", (width, side * len(tiles)), "white")
    for row, (picture, blended) in enumerate(tiles):
        figure.paste(picture, (0, row * side))
        figure.paste(blended, (width // 2, row * side))
    figure.save(path)
    return path
