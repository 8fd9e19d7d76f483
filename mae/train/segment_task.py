"""Segmentation's task for the one loop, and its metrics: a confusion matrix over every labeled pixel (the
ignore index left out), summed over processes (integers: 2 processes give exactly what 1 gives), and the
scores read from it: mIoU, pixel accuracy and per-class IoU, in percent."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from mae.data.masks import IGNORE
from mae.train.accelerator import plain_model
from mae.train.metrics import report_bad_files


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore: int = IGNORE):
    """[K, K] int64 counts, row = true class, column = predicted, of pixels whose target is not `ignore`."""
    keep = target != ignore
    index = target[keep].long() * num_classes + pred[keep].long()
    return torch.bincount(index, minlength=num_classes**2).reshape(num_classes, num_classes)


def segmentation_scores(confusion: torch.Tensor) -> dict[str, Any]:
    """mIoU (the mean over classes present in the targets or predictions), pixel accuracy and per-class IoU (None
    for a class never seen nor predicted), all in percent."""
    c = confusion.double()
    tp, union = c.diag(), c.sum(0) + c.sum(1) - c.diag()
    iou = [100.0 * t / u if u > 0 else None for t, u in zip(tp.tolist(), union.tolist(), strict=True)]
    present = [v for v in iou if v is not None]
    total = c.sum().item()
    return {
        "miou": sum(present) / len(present) if present else math.nan,
        "pixel_acc": 100.0 * tp.sum().item() / total if total else math.nan,
        "per_class_iou": iou,
    }


@torch.no_grad()
def evaluate_segmenter(
    model: torch.nn.Module, loader: Any, num_classes: int, accelerator: Accelerator | None = None
) -> dict[str, Any]:
    """Every image of `loader` (this process's part) segmented at its own size (`Segmenter.segment`); the
    confusion matrix, cross-entropy and counts summed over processes. Returns the scores, `loss` and `samples`."""
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, labeled pixels, images
    bad = []
    for batch in loader:
        bad.extend(batch.get("bad", []))
        if batch["image"] is None:
            continue
        for image, mask in same_size_groups(batch["image"], batch["mask"]):
            with accelerator.autocast() if accelerator is not None else torch.autocast("cpu", enabled=False):
                logits = model.segment(image.to(device)).float()
            mask = mask.to(device)
            confusion += confusion_matrix(logits.argmax(1), mask, num_classes)
            loss = F.cross_entropy(logits, mask, ignore_index=IGNORE, reduction="sum")
            sums += torch.tensor([loss.item(), (mask != IGNORE).sum().item(), len(image)], device=device,
                                 dtype=torch.float64)  # fmt: skip
    model.train(was_training)
    if accelerator is not None:
        report_bad_files(accelerator, bad, [])
        confusion, sums = accelerator.reduce(confusion, "sum"), accelerator.reduce(sums, "sum")
    scores = segmentation_scores(confusion.cpu())
    loss = sums[0].item() / sums[1].item() if sums[1].item() else math.nan
    return {"loss": loss, **scores, "samples": int(sums[2].item())}


def same_size_groups(images: Any, masks: Any):
    """(images [n, C, H, W], masks [n, H, W]) of a batch: itself when stacked, else runs of one size."""
    if isinstance(images, torch.Tensor):
        yield images, masks
        return
    start = 0
    for end in range(1, len(images) + 1):
        if end == len(images) or images[end].shape != images[start].shape:
            yield torch.stack(images[start:end]), torch.stack(masks[start:end])
            start = end


class SegmentTask:
    """Per-pixel cross-entropy (ignore index 255) of a `Segmenter`; evaluation over `val_loader` (each process's
    share of the validation images, not prepared: no sample is repeated to even out the processes)."""

    def __init__(self, model: torch.nn.Module, *, accelerator: Accelerator, val_loader: Any, num_classes: int) -> None:
        self.model, self.accelerator = model, accelerator
        self.val_loader, self.num_classes = val_loader, num_classes
        self.last_evaluation: dict[str, Any] = {}

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = self.model(batch["image"]).float()
        return {"loss": F.cross_entropy(logits, batch["mask"], ignore_index=IGNORE)}

    def after_step(self) -> None:
        pass

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any]:
        model = plain_model(self.accelerator, self.model)
        result = evaluate_segmenter(model, self.val_loader, self.num_classes, self.accelerator)
        self.last_evaluation = {"eval": "val", **result}
        return self.last_evaluation
