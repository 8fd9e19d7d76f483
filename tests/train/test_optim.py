"""The optimizers and schedules the stages build, against the paper's numbers computed here from its formulas."""

import json
import math

import pytest
import torch
from accelerate.state import AcceleratorState

import mae
from mae.cli import main, parse
from mae.config import FinetuneConfig, LinprobeConfig, PretrainConfig
from mae.train.optim import adamw, base_lr, effective_batch
from tests.conftest import make_images


def groups_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    return {n: group_of[id(p)] for n, p in model.named_parameters() if p.requires_grad}


def decays(name: str, p: torch.Tensor, exempt: set[str]) -> bool:
    """The official MAE's rule (timm's `param_groups_weight_decay`): no decay on biases, norms and 1-d tensors,
    nor on what the model lists in `no_weight_decay()`."""
    return not (p.ndim <= 1 or name.endswith(".bias") or name in exempt)


def test_pretraining_uses_adamw_095_and_exempts_biases_norms_and_tokens():
    cfg = PretrainConfig()
    paper = ((0.9, 0.95), 0.05, 1.5e-4, 0.75)
    assert (cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.blr, cfg.model.mask_ratio) == paper
    model = mae.create_mae("mae_vit_micro_patch8")
    opt = adamw(model, lr=1e-3, weight_decay=cfg.optim.weight_decay, betas=tuple(cfg.optim.betas))
    assert isinstance(opt, torch.optim.AdamW) and all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    exempt = {n for n, _ in model.named_parameters() if n.split(".")[-1] in ("cls_token", "mask_token", "pos_embed")}
    by_name = groups_by_name(model, opt)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert by_name[name]["weight_decay"] == (0.05 if decays(name, p, exempt) else 0.0), name
    assert any(g["weight_decay"] == 0.05 for g in opt.param_groups)


def test_finetuning_decays_each_layers_lr_by_its_depth():
    from mae.models.classifier import build_classifier
    from mae.weights.importers import read_encoder

    cfg = FinetuneConfig()
    assert (cfg.optim.betas, cfg.optim.layer_decay, cfg.model.drop_path) == ((0.9, 0.999), 0.75, 0.1)
    assert (cfg.aug.mixup, cfg.aug.cutmix, cfg.aug.smoothing, cfg.aug.auto_augment[:7]) == (0.8, 1.0, 0.1, "rand-m9")
    model, _, _ = build_classifier(read_encoder("random:mae_vit_micro_patch8", 32), 3, img_size=32, global_pool="avg")
    opt = adamw(model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), layer_decay=0.75)
    depth = len(model.blocks)
    num_layers = depth + 1

    def layer_id(name: str) -> int:  # the official MAE's get_layer_id_for_vit
        if name.split(".")[0] in ("cls_token", "pos_embed", "patch_embed", "reg_token"):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return num_layers

    exempt = set(model.no_weight_decay())
    for name, g in groups_by_name(model, opt).items():
        p = model.get_parameter(name)
        assert g["lr_scale"] == pytest.approx(0.75 ** (num_layers - layer_id(name))), name
        assert g["weight_decay"] == (0.05 if decays(name, p, exempt) else 0.0), name
        assert g["betas"] == (0.9, 0.999)
    assert groups_by_name(model, opt)["head.weight"]["lr_scale"] == 1.0
    assert groups_by_name(model, opt)["patch_embed.proj.weight"]["lr_scale"] == pytest.approx(0.75**num_layers)


def test_adamw_takes_the_fused_kernel_and_builds_the_plain_one_where_torch_has_none(monkeypatch):
    import timm.optim

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fused = adamw(model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.95))
    assert fused.defaults["fused"]  # torch has the CPU kernel since 2.4
    real = timm.optim.create_optimizer_v2

    def without_fused(*args, **kwargs):  # a torch whose AdamW takes no `fused`
        if "fused" in kwargs:
            raise TypeError("__init__() got an unexpected keyword argument 'fused'")
        return real(*args, **kwargs)

    monkeypatch.setattr(timm.optim, "create_optimizer_v2", without_fused)
    plain = adamw(model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.95))
    assert isinstance(plain, torch.optim.AdamW) and not plain.defaults["fused"]
    assert [(g["weight_decay"], len(g["params"])) for g in plain.param_groups] == [(0.0, 3), (0.05, 1)]
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.9, 0.95) for g in plain.param_groups)


@pytest.mark.parametrize("config", [PretrainConfig, LinprobeConfig, FinetuneConfig])
def test_lr_is_blr_times_effective_batch_over_256(config):
    from dataclasses import replace

    cfg = config()
    cfg = replace(cfg, loop=replace(cfg.loop, batch_size=24, accum_steps=3))
    for processes in (1, 2, 8):
        assert effective_batch(cfg, processes) == 24 * 3 * processes
        assert base_lr(cfg, processes) == pytest.approx(cfg.optim.blr * 24 * 3 * processes / 256)
    assert base_lr(replace(cfg, optim=replace(cfg.optim, lr=0.123)), 8) == 0.123  # an absolute lr wins
    assert {PretrainConfig: 1.5e-4, LinprobeConfig: 0.1, FinetuneConfig: 1e-3}[config] == cfg.optim.blr


def test_the_probe_uses_lars_from_an_effective_batch_of_256():
    from types import SimpleNamespace

    from timm.optim import Lars

    from mae.models.classifier import probe_head
    from mae.stages.linprobe import probe_optimizer, probe_optimizer_name

    optim = LinprobeConfig().optim
    assert (optim.momentum, optim.weight_decay, optim.blr) == (0.9, 0.0, 0.1)
    quiet = SimpleNamespace(is_main_process=False)
    assert [probe_optimizer_name(optim, b, quiet) for b in (255, 256, 16384)] == ["sgd", "lars", "lars"]
    head = probe_head(16, 3)
    assert isinstance(head[0], torch.nn.BatchNorm1d) and not head[0].affine  # BN without affine, then linear
    lars = probe_optimizer(head, optim, 0.5, "lars")
    assert isinstance(lars, Lars) and [g["params"] for g in lars.param_groups] == [[head[1].weight], [head[1].bias]]
    assert lars.param_groups[0]["always_adapt"] and lars.param_groups[1]["weight_decay"] == 0.0
    assert all(g["momentum"] == 0.9 and g["lr"] == 0.5 for g in lars.param_groups)


def test_a_run_follows_warmup_then_cosine_at_every_step(tmp_path):
    """16 images in batches of 2 with 2 accumulation steps: 4 optimizer steps an epoch, 12 in all, the first 6
    warming up (1.5 epochs); lr = blr x 4 / 256. Step s (1-based, as logged) ran at the lr of step s - 1."""
    make_images(tmp_path / "imgs", n=16)
    AcceleratorState._reset_state(True)
    assert main(["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--data.num_workers",
                 "0", "--loop.progress", "false", "--loop.mixed_precision", "no", "--loop.log_every", "1",
                 "--loop.epochs", "3", "--loop.batch_size", "2", "--loop.accum_steps", "2", "--optim.blr", "0.64",
                 "--optim.min_lr", "0.001", "--optim.warmup_epochs", "1.5", "--data.path", str(tmp_path / "imgs"),
                 "--output_dir", str(tmp_path / "run")]) == 0  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {m["step"]: m["lr"] for m in lines if "eval" not in m}
    peak, warmup, total, floor = 0.64 * 4 / 256, 6, 12, 0.001
    expected = {s: peak * (s - 1) / warmup if s - 1 < warmup else
                floor + (peak - floor) * (1 + math.cos(math.pi * (s - 1 - warmup) / (total - warmup))) / 2
                for s in range(1, total + 1)}  # fmt: skip
    assert logged.keys() == expected.keys()
    assert all(logged[s] == pytest.approx(expected[s], rel=1e-12, abs=1e-15) for s in expected), logged
    assert logged[7] == pytest.approx(peak)


def test_the_command_line_overrides_a_value_the_recipe_sets(tmp_path):
    recipe = "recipes/finetune/vit_base_in1k.yaml"
    from_yaml = parse("finetune", ["--config", recipe, "--data.path", "x"])
    assert (from_yaml.optim.blr, from_yaml.optim.layer_decay, from_yaml.loop.batch_size) == (5e-4, 0.65, 32)
    cfg = parse("finetune", ["--config", recipe, "--optim.layer_decay", "0.5", "--loop.batch_size", "8",
                             "--data.path", "x"])  # fmt: skip
    assert (cfg.optim.blr, cfg.optim.layer_decay, cfg.loop.batch_size) == (5e-4, 0.5, 8)
    before = parse("finetune", ["--optim.layer_decay", "0.5", "--config", recipe, "--data.path", "x"])
    assert before.optim.layer_decay == 0.65  # in order, as jsonargparse reads them: a later recipe wins
