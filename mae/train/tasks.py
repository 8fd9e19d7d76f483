"""Tasks: what differs between stages. The loop (`mae.train.loop.fit`) is shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from mae.data.transforms import normalize
from mae.visualize import reconstruction_grid, save_grid


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
    ) -> None:
        self.model = model
        self.accelerator = accelerator
        self.mean, self.std = mean, std
        self.preview_batch = preview_batch
        self.output_dir = output_dir

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        imgs = normalize(batch["image"], self.mean, self.std)
        return {"loss": self.model(imgs, noise=batch["noise"]).loss}

    def evaluate(self, epoch: int, final: bool) -> dict[str, Any] | None:
        if self.preview_batch is None or not self.accelerator.is_main_process:
            return None
        model = self.accelerator.unwrap_model(self.model)
        with self.accelerator.autocast():
            grid, loss = reconstruction_grid(
                model, self.preview_batch["image"], self.preview_batch["noise"], self.mean, self.std
            )
        save_grid(grid, self.output_dir / "previews" / f"epoch_{epoch:04d}.png")
        save_grid(grid, self.output_dir / "preview.png")
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_image("reconstructions", grid, epoch)
        return {"eval": "preview", "loss": loss, "preview": f"previews/epoch_{epoch:04d}.png"}
