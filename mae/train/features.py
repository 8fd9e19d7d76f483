"""Frozen features and the weighted k-NN classifier (Wu et al. 2018; the DINO/MAE protocol)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from mae.errors import DataError
from mae.train.metrics import report_bad_files


@torch.no_grad()
def predict(
    model: nn.Module,
    loader: Iterable[dict[str, Any]],
    accelerator: Accelerator | None = None,
    bad_seen: list[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [N, ...] float32 on the CPU, labels [N]) of `model` over every batch of `loader`.

    The one evaluation pass: classifier logits, probe features, k-NN features. The model runs in eval
    mode (restored after). With an `accelerator` (every process calling, the loader prepared), outputs
    are computed under the run's autocast and gathered exactly, as one process would see them, and
    unreadable files are reported once (`bad_seen` collects their names); without one, on the model's
    device, under the caller's autocast.
    """
    was_training = model.training
    model.eval()
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    processes = accelerator.num_processes if accelerator is not None else 1
    # A stream's part (`EvalStream`) has its own length on each process: gathered once, at the end. Other
    # loaders are gathered batch by batch, of unequal sizes where unreadable files were left out.
    streamed = getattr(loader, "streamed", False)
    per_batch = processes > 1 and not streamed
    outputs, labels, indices, bad = [], [], [], []
    for batch in loader:
        bad.extend(batch.get("bad", []))
        out, y = None, batch["label"]
        if batch["image"] is not None:
            with accelerator.autocast() if accelerator is not None else contextlib.nullcontext():
                out = model(batch["image"].to(device)).float()
        if per_batch:  # every process takes part in every batch's gathers, readable images or none
            out, y, index = _gather_uneven(accelerator, out, batch)
        if out is not None:
            outputs.append(out.cpu())
            labels.append(y.cpu())
            if per_batch:
                indices.append(index)
    model.train(was_training)
    if accelerator is not None:
        report_bad_files(accelerator, bad, [] if bad_seen is None else bad_seen)
    if streamed and processes > 1:
        return _gather_parts(accelerator, outputs, labels)
    if not outputs:
        raise _unreadable()
    outputs, labels = torch.cat(outputs), torch.cat(labels)
    if per_batch:  # each sample once: the samples Accelerate repeats to even out the last batch are dropped
        index = torch.cat(indices)
        order = torch.argsort(index, stable=True)
        ranked = index[order]
        first = torch.ones(len(order), dtype=torch.bool)
        first[1:] = ranked[1:] != ranked[:-1]
        outputs, labels = outputs[order[first]], labels[order[first]]
    return outputs, labels


def _gather_uneven(accelerator: Accelerator, out: torch.Tensor | None, batch: dict[str, Any]):
    """(outputs, labels, dataset indices) of a batch from every process, which may hold different numbers of
    readable images (none at all on some): padded to the largest, gathered, the padding dropped. (None, None,
    None) when no process read any."""
    # Not Accelerate's `pad_across_processes`: a process that read no image of the batch has no tensor (nor
    # feature width) to pad, so sizes and widths are gathered first.
    device = accelerator.device
    n = 0 if out is None else len(out)
    width = 0 if out is None else out.shape[1]
    sizes = accelerator.gather(torch.tensor([[n, width]], device=device)).view(-1, 2)
    most, width = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    if most == 0:
        return None, None, None
    padded = torch.zeros(most, width, device=device)
    y, index = torch.zeros(most, dtype=torch.long, device=device), torch.zeros(most, dtype=torch.long, device=device)
    if n:
        padded[:n], y[:n], index[:n] = out, batch["label"].to(device), batch["index"].to(device)
    out, y, index = accelerator.gather((padded, y, index))
    real = (torch.arange(most, device=device)[None, :] < sizes[:, :1]).flatten()
    return out[real], y[real], index[real].cpu()


def _unreadable() -> DataError:
    return DataError(
        "no image could be read: every file was skipped as unreadable (each is warned above); check --data.path "
        "and --data.val_path (and --data.image_column)"
    )


def _gather_parts(accelerator: Accelerator, outputs: list, labels: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Every process's outputs and labels, of different lengths, concatenated in process order."""
    from accelerate.utils import gather_object

    parts = gather_object([(torch.cat(outputs) if outputs else None, torch.cat(labels) if labels else None)])
    parts = [p for p in parts if p[0] is not None]
    if not parts:
        raise _unreadable()
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def knn_scores(
    train_feats: torch.Tensor,
    train_labels: torch.Tensor,
    query_feats: torch.Tensor,
    *,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk: int = 1024,
) -> torch.Tensor:
    """Class scores [Q, C]: each query's k most cosine-similar training samples vote for their
    class with weight exp(similarity / temperature)."""
    bank = F.normalize(train_feats.float(), dim=1)
    k = min(k, len(bank))
    out = []
    # Similarities in fp32 even inside a bf16 autocast region: neighbour ranks depend on small gaps.
    with torch.autocast(bank.device.type, enabled=False):
        for start in range(0, len(query_feats), chunk):
            q = F.normalize(query_feats[start : start + chunk].float(), dim=1)
            sims, idx = (q @ bank.T).topk(k, dim=1)
            weights = (sims / temperature).exp()
            votes = torch.zeros(len(q), num_classes)
            votes.scatter_add_(1, train_labels[idx], weights)
            out.append(votes)
    return torch.cat(out)


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """top1 (and top5 where there are at least 5 classes), in percent (timm's `accuracy`)."""
    from timm.utils import accuracy

    ks = (1, 5) if scores.shape[1] >= 5 else (1,)
    return {f"top{k}": value.item() for k, value in zip(ks, accuracy(scores, labels, topk=ks), strict=True)}


class KnnMonitor:
    """k-NN top-1 of an encoder on a fixed labeled split, for watching pretraining (main process only).

    `samples_bank` / `samples_query` yield {"image", "label"} batches on the CPU; the encoder's pooled
    output (`encoder(images)`, the cls token for an MAE encoder) is the feature.
    """

    def __init__(self, bank_loader, query_loader, *, num_classes: int, k: int, temperature: float) -> None:
        self.bank_loader, self.query_loader = bank_loader, query_loader
        self.num_classes, self.k, self.temperature = num_classes, k, temperature

    @torch.no_grad()
    def __call__(self, encoder: nn.Module) -> dict[str, float]:
        bank, bank_labels = predict(encoder, self.bank_loader)
        query, labels = predict(encoder, self.query_loader)
        scores = knn_scores(
            bank, bank_labels, query, num_classes=self.num_classes, k=self.k, temperature=self.temperature
        )
        return topk_accuracy(scores, labels)
