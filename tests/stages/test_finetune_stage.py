"""What `mae finetune` hands the training loop (mae/stages/finetune.py), seen in this process by standing in for
`train`: the LP-FT head (the optimum of its L2-regularised logistic regression, its logged line) or the paper's
near-zero head, none on resume; the crop's decode size; mixup, cutmix and label smoothing and their loss; mixup's
stream and the EMA checkpointed; the start line. Training itself is the loop's (tests/train/test_fit.py) and the
end-to-end runs are tests/train/test_downstream.py's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import ModelEmaV3

import mae
from mae.data.transforms import crop_decode_side
from mae.stages import finetune as ft
from mae.stages.registry import get_stage
from tests.conftest import make_labeled


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    return make_labeled(tmp_path_factory.mktemp("labeled"), per_class=8)


@pytest.fixture
def handed(monkeypatch):
    """What the stage gives `train`, `LabeledSamples` and `predict` (the probe's features), recorded."""
    seen = {"features": [], "samples": []}
    real_predict, real_samples = ft.predict, ft.LabeledSamples

    def predict(*args, **kwargs):
        seen["features"].append(real_predict(*args, **kwargs))
        return seen["features"][-1]

    def samples(*args, **kwargs):
        seen["samples"].append(kwargs)
        return real_samples(*args, **kwargs)

    def train(cfg, **kwargs):
        model = kwargs["model"]
        seen.update(kwargs, head=(model.head.weight.detach().clone(), model.head.bias.detach().clone()))
        seen["task"] = kwargs["task"](model, None)
        seen["task"].last_evaluation = {"eval": "val", "loss": 1.0, "top1": 100.0, "samples": 6}
        return model, seen["task"]

    monkeypatch.setattr(ft, "predict", predict)
    monkeypatch.setattr(ft, "LabeledSamples", samples)
    monkeypatch.setattr(ft, "train", train)
    return seen


def finetune(tmp_path, labeled, encoder, **sections):
    AcceleratorState._reset_state(True)
    data = {"path": labeled, "num_workers": 0, "val_fraction": 0.25, **sections.pop("data", {})}
    loop = {"progress": False, "batch_size": 8, "mixed_precision": "no", **sections.pop("loop", {})}
    return mae.finetune(pretrained=encoder, data=data, loop=loop, output_dir=tmp_path, **sections)


def test_the_probe_head_is_the_regularised_logistic_regression_optimum_and_is_logged(
    tmp_path, labeled, micro_encoder, handed, capsys
):
    finetune(tmp_path, labeled, micro_encoder)
    (x, y), (vx, vy) = handed["features"]  # the training images', then the validation images'
    weight, bias = (t.clone().requires_grad_() for t in handed["head"])
    objective = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + 1e-4 * weight.pow(2).sum()
    objective.backward()
    assert weight.grad.norm() < 1e-3 and bias.grad.norm() < 1e-3  # the optimum of the penalised objective
    assert weight.detach().abs().max() > 0.01  # not the near-zero start
    logits = vx @ weight.detach().T + bias.detach()
    top1 = 100.0 * (logits.argmax(1) == vy).float().mean().item()
    (record,) = handed["preamble"]
    assert record["eval"] == "probe_init" and (record["step"], record["epoch"], record["samples"]) == (0, 0, len(vy))
    assert record["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, vy).item(), rel=1e-5)
    assert record["top1"] == pytest.approx(top1)
    line = f"head from a linear probe (LP-FT): top1 {top1:.2f}% on {len(vy)} validation images"
    assert line in capsys.readouterr().out.splitlines()


def test_a_random_head_is_the_papers_near_zero_one_and_nothing_is_probed(tmp_path, labeled, micro_encoder, handed):
    finetune(tmp_path, labeled, micro_encoder, model={"head_init": "random"})
    assert handed["preamble"] == [] and handed["features"] == []
    assert 0 < handed["head"][0].std() < 1e-4  # trunc_normal_(std=2e-5)


def test_a_resumed_run_fits_no_probe(tmp_path, labeled, micro_encoder, handed, monkeypatch):
    real = ft.open_downstream

    def resuming(cfg):
        return dataclasses.replace(real(cfg), resume_from=tmp_path / "checkpoints" / "step_00000001")

    monkeypatch.setattr(ft, "open_downstream", resuming)
    finetune(tmp_path, labeled, micro_encoder)
    assert handed["preamble"] == [] and handed["features"] == []


def test_the_training_images_decode_at_the_size_the_smallest_crop_needs(tmp_path, labeled, micro_encoder, handed):
    finetune(tmp_path, labeled, micro_encoder, model={"img_size": 224}, aug={"crop_scale": [0.08, 1.0]})
    (kwargs,) = handed["samples"]
    assert kwargs["decode_side"] == crop_decode_side((224, 224), 0.08) != crop_decode_side((224, 224), 1.0)


@pytest.mark.parametrize(
    ("aug", "criterion"),
    [
        ({}, SoftTargetCrossEntropy),  # the paper's: mixup 0.8, cutmix 1.0, smoothing 0.1
        ({"mixup": 0.0, "cutmix": 0.5}, SoftTargetCrossEntropy),
        ({"cutmix": 0.0}, SoftTargetCrossEntropy),
        ({"mixup": 0.0, "cutmix": 0.0}, LabelSmoothingCrossEntropy),
        ({"mixup": 0.0, "cutmix": 0.0, "smoothing": 0.0}, torch.nn.CrossEntropyLoss),
    ],
)
def test_mixing_and_smoothing_pick_the_loss_and_mixup_is_checkpointed(tmp_path, labeled, micro_encoder, handed, aug,
                                                                      criterion):  # fmt: skip
    finetune(tmp_path, labeled, micro_encoder, aug=aug)
    task, acc = handed["task"], handed["accelerator"]
    assert type(task.criterion) is criterion
    options = {"mixup": 0.8, "cutmix": 1.0, "smoothing": 0.1, **aug}
    if criterion is LabelSmoothingCrossEntropy:
        assert task.criterion.smoothing == options["smoothing"]
    if criterion is SoftTargetCrossEntropy:
        mix = task.mixup.mixup
        assert (mix.mixup_alpha, mix.cutmix_alpha, mix.label_smoothing) == tuple(options.values())
        assert mix.num_classes == 3 and acc._custom_objects == [task.mixup]
    else:
        assert task.mixup is None and acc._custom_objects == []


def test_an_ema_is_kept_and_checkpointed_only_when_asked(tmp_path, labeled, micro_encoder, handed):
    finetune(tmp_path, labeled, micro_encoder)
    assert handed["task"].ema is None
    finetune(tmp_path / "ema", labeled, micro_encoder, model={"ema_decay": 0.5})
    ema = handed["task"].ema
    assert isinstance(ema, ModelEmaV3) and ema.decay == 0.5 and ema in handed["accelerator"]._custom_objects


def test_the_start_line_names_the_encoder_the_images_and_the_classes(tmp_path, labeled, micro_encoder, handed):
    finetune(tmp_path, labeled, micro_encoder)
    assert handed["title"].startswith("fine-tuning a ") and handed["title"].endswith(" on 18 images, 3 classes")
    assert get_stage("finetune").description == "Fine-tune the whole ViT with a fresh classifier head."


def test_an_odd_batch_cannot_be_mixed(tmp_path, labeled, micro_encoder, handed):
    with pytest.raises(mae.ConfigError) as error:
        finetune(tmp_path, labeled, micro_encoder, loop={"batch_size": 7})
    assert str(error.value) == (
        "--loop.batch_size 7: mixup and cutmix pair the samples of a batch, so it must be even; choose an even batch "
        "size or set --aug.mixup 0 --aug.cutmix 0"
    )
    for either in ({"cutmix": 0.0}, {"mixup": 0.0, "cutmix": 0.5}):
        with pytest.raises(mae.ConfigError, match="^--loop.batch_size 7: mixup and cutmix pair"):
            finetune(tmp_path, labeled, micro_encoder, loop={"batch_size": 7}, aug=either)
    finetune(
        tmp_path, labeled, micro_encoder, loop={"batch_size": 7}, aug={"mixup": 0.0, "cutmix": 0.0}
    )  # unmixed: fine


def test_mixup_draws_only_from_its_own_stream():
    mix = ft.OwnStreamMixup(SimpleNamespace(), seed=3)
    draws = []
    mix.mixup = lambda x, t: draws.append(np.random.rand()) or (x, t)
    np.random.seed(0)
    outer = np.random.get_state()[1].copy()
    mix(torch.zeros(2), torch.zeros(2))
    mix(torch.zeros(2), torch.zeros(2))
    assert (np.random.get_state()[1] == outer).all()  # the global stream untouched
    assert draws == pytest.approx(list(np.random.RandomState(3).rand(2)))


def test_the_classifier_saved_is_the_gathered_state(tmp_path, labeled, micro_encoder, handed, monkeypatch):
    """Under FSDP only `full_state_dict` holds every weight (each process has a shard): the stage saves what it
    gathers, not the process's own module (here a marked copy tells them apart)."""
    real = ft.full_state_dict

    def gathered(accelerator, model):
        state = real(accelerator, model)
        return {**state, "head.bias": state["head.bias"] + 1.0}

    monkeypatch.setattr(ft, "full_state_dict", gathered)
    result = finetune(tmp_path, labeled, micro_encoder, model={"head_init": "random"})
    saved = load_file(result.export)
    assert torch.equal(saved["head.bias"], handed["model"].head.bias.detach() + 1.0)
