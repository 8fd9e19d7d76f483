"""`mae knn`: weighted k-NN classification with the frozen encoder's features (the DINO/MAE protocol): the
validation images vote among the training images."""

from __future__ import annotations

from pathlib import Path

import yaml

from mae.config import KnnConfig
from mae.models.classifier import build_classifier
from mae.run_folder import CONFIG, METRICS
from mae.stages.downstream import labeled_eval_loader, open_downstream
from mae.stages.registry import StageResult, register_stage
from mae.train.accelerator import close_accelerator
from mae.train.checkpoint import config_record
from mae.train.features import knn_scores, predict, topk_accuracy
from mae.train.loaders import prepare_eval
from mae.train.metrics import MetricsWriter
from mae.train.speed import configure_speed, maybe_compile


@register_stage("knn", KnnConfig, "Weighted k-NN classification with the frozen encoder's features.")
def run_knn(cfg: KnnConfig) -> StageResult:
    """Weighted k-NN on frozen features: the validation set votes among the training set."""
    setup = open_downstream(cfg)
    accelerator = setup.accelerator
    encoder, _, _ = build_classifier(
        setup.encoder, 0, img_size=cfg.model.img_size, global_pool=cfg.model.pool, fc_norm=False
    )
    encoder.to(accelerator.device)
    configure_speed(encoder, accelerator.device.type, accelerator.mixed_precision, cfg.loop.attention)
    encoder = maybe_compile(encoder, cfg.loop.compile, accelerator.device.type)
    bank, bank_labels = predict(encoder, prepare_eval(accelerator, labeled_eval_loader(setup, setup.train, cfg)),
                                accelerator)  # fmt: skip
    query, labels = predict(encoder, prepare_eval(accelerator, labeled_eval_loader(setup, setup.val, cfg)),
                            accelerator)  # fmt: skip
    scores = knn_scores(bank, bank_labels, query, num_classes=len(setup.classes), k=cfg.k, temperature=cfg.temperature)
    probs = scores / scores.sum(1, keepdim=True).clamp_min(1e-12)
    nll = -probs.gather(1, labels[:, None]).clamp_min(1e-12).log().mean().item()
    result = {"step": 0, "epoch": 0, "eval": "knn", "loss": nll, **topk_accuracy(scores, labels), "k": cfg.k,
              "samples": len(labels)}  # fmt: skip
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG).write_text(yaml.safe_dump(config_record(cfg), sort_keys=False))
        (out / METRICS).unlink(missing_ok=True)
    MetricsWriter(accelerator, out).write(result)
    top5 = f", top5 {result['top5']:.2f}%" if "top5" in result else ""
    top1 = f"top1 {result['top1']:.2f}%"
    accelerator.print(f"k-NN (k={cfg.k}, T={cfg.temperature}): {top1}{top5} on {len(labels)} images")
    close_accelerator(accelerator)
    return StageResult(out, result)
