"""Tasks: what differs between stages. The loop (`mae.train.loop.fit`) is shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from mae.data.transforms import normalize
from mae.figures import reconstruction_grid, save_grid
from mae.run_folder import PREVIEW, preview_path
from mae.train.accelerator import plain_model
from mae.train.features import predict, topk_accuracy


class PretrainTask:
    """Masked-autoencoder pretraining; its evaluation is a reconstruction preview."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        accelerator: Accelerator,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        preview_batch: dict[str, torch.Tensor] | None,
        output_dir: Path,
        preview_bands: tuple[int, int, int] | None = None,
        knn_monitor: Any = None,
    ) -> None:
        self.model = model
        self.accelerator = accelerator
        self.mean, self.std = mean, std
        self.preview_batch = preview_batch
        self.output_dir = output_dir
        self.knn_monitor = knn_monitor
        self.preview_bands = preview_bands
        self.last_evaluation: dict[str, Any] = {}
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if self._stats is None or self._stats[0].device != batch["image"].device:
            device = batch["image"].device  # made once on the training device, not copied from the host per step
            self._stats = (torch.tensor(self.mean, device=device), torch.tensor(self.std, device=device))
        imgs = normalize(batch["image"], *self._stats)
        return {"loss": self.model(imgs, noise=batch["noise"]).loss}

    def after_step(self) -> None:
        pass

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any] | None:
        if self.preview_batch is None or not self.accelerator.is_main_process:
            return None
        model = plain_model(self.accelerator, self.model)
        with self.accelerator.autocast():
            grid, loss = reconstruction_grid(
                model, self.preview_batch["image"], self.preview_batch["noise"], self.mean, self.std, self.preview_bands
            )
        save_grid(grid, self.output_dir / preview_path(epoch))
        save_grid(grid, self.output_dir / PREVIEW)
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_image("reconstructions", grid, epoch)
        result = {"eval": "preview", "loss": loss, "preview": preview_path(epoch)}
        if self.knn_monitor is not None:
            with self.accelerator.autocast():
                result.update({f"knn_{k}": v for k, v in self.knn_monitor(model.encoder).items()})
        self.last_evaluation = result
        return result


class ClassifierTask:
    """Supervised training of `model` (a full ViT, a probe, or a head over cached features).

    `mixup` (timm's `Mixup`) mixes inputs and targets; `criterion` takes the (soft) targets.
    Evaluation: cross-entropy and top-1/top-5 over the whole validation set, gathered exactly
    across processes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        accelerator: Accelerator,
        criterion: torch.nn.Module,
        val_loader: torch.utils.data.DataLoader,
        mixup: Any = None,
        ema: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.accelerator = accelerator
        self.criterion = criterion
        self.val_loader = val_loader
        self.mixup = mixup
        self.ema = ema
        self.bad_val_files: list[str] = []
        self.last_evaluation: dict[str, Any] = {}

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        x, y = batch["image"], batch["label"]
        if self.mixup is not None:
            if len(x) % 2:  # timm's Mixup pairs samples; a batch that lost a file to decoding drops one more
                x, y = x[:-1], y[:-1]
            x, y = self.mixup(x, y)
        return {"loss": self.criterion(self.model(x), y)}

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update(plain_model(self.accelerator, self.model))

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any]:
        model = self.ema.module if self.ema is not None else self.model
        logits, labels = predict(model, self.val_loader, self.accelerator, self.bad_val_files)
        loss = torch.nn.functional.cross_entropy(logits, labels).item()
        self.last_evaluation = {"eval": "val", "loss": loss, **topk_accuracy(logits, labels), "samples": len(labels)}
        return self.last_evaluation
