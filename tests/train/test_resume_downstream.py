"""Kills and resumes of the downstream stages (linear probe, fine-tuning), as pretraining's in test_reliability:
killed mid-epoch and run again, a stage ends with the weights and the metrics of a run never interrupted."""

import json
import signal
from pathlib import Path

import pytest
from safetensors.torch import load_file

import mae
from tests.conftest import make_labeled
from tests.train.test_reliability import assert_same_tensors, child, final_weights

COMMON = ["--loop.mixed_precision", "no", "--loop.progress", "false", "--loop.log_every", "1", "--seed", "3",
          "--loop.epochs", "3", "--loop.batch_size", "4", "--loop.checkpoint_every", "2"]  # fmt: skip
STAGES = {
    # fine-tuning with everything random the recipe has: RandAugment, random erasing, mixup/cutmix, drop path, EMA
    "finetune": ["finetune", "--model.ema_decay", "0.9", "--optim.warmup_epochs", "1"],
    "linprobe": ["linprobe", "--optim.warmup_epochs", "1"],  # cached features
    "linprobe_augmented": ["linprobe", "--mode", "augmented", "--augment", "true", "--optim.warmup_epochs", "1"],
}


def kill_at_call(task: str, n: int = 7) -> str:
    """Code for `child`: SIGKILL the process at the n-th call of `task`'s forward (`module:Class`); with n = 7,
    mid-epoch 2, one step after the checkpoint of step 6."""
    module, cls = task.split(":")
    return f"""
    from {module} import {cls}
    f = {cls}.forward
    calls = [0]
    def forward(self, batch):
        calls[0] += 1
        if calls[0] == {n}:
            os.kill(os.getpid(), signal.SIGKILL)
        return f(self, batch)
    {cls}.forward = forward
"""


KILL_AT_STEP_7 = kill_at_call("mae.train.tasks:ClassifierTask")
TIMING = {"img_per_s", "data_wait"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("downstream")
    make_labeled(root / "lab", per_class=8)
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), root / "enc.safetensors")
    return root / "lab", enc


def stage_args(stage: str, data: tuple[Path, Path], workers: int = 0) -> list[str]:
    lab, enc = data
    return [*STAGES[stage], *COMMON, "--pretrained", str(enc), "--data.path", str(lab),
            "--data.num_workers", str(workers)]  # fmt: skip


def metrics(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING} for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_sigkill_mid_epoch_then_rerun_is_bit_identical(tmp_path, data, stage):
    args = stage_args(stage, data)
    whole = child(tmp_path / "whole", args=args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = child(tmp_path / "run", KILL_AT_STEP_7, args=args)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000004", "step_00000006"]
    resumed = child(tmp_path / "run", args=args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "step 6" in resumed.stdout
    assert_same_tensors(final_weights(tmp_path / "run"), final_weights(tmp_path / "whole"))
    classifier = [load_file(d / "classifier.safetensors") for d in (tmp_path / "run", tmp_path / "whole")]
    assert_same_tensors(*classifier)
    assert metrics(tmp_path / "run") == metrics(tmp_path / "whole")
    evals = [m for m in metrics(tmp_path / "whole") if m.get("eval") == "val"]
    assert [m["epoch"] for m in evals] == ([1, 2, 3] if stage == "finetune" else [3])


def test_a_pass_over_a_loader_leaves_torchs_global_generator_alone():
    """Each pass draws its workers' seed: from the loader's own generator, not the one dropout and drop path use."""
    import torch

    from mae.train.loaders import make_loader

    loader = make_loader(list(range(8)), batch_size=4, collate_fn=torch.tensor, num_workers=0)
    before = torch.random.get_rng_state()
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(torch.random.get_rng_state(), before)


def test_mixup_draws_from_a_stream_of_its_own_that_checkpoints_restore():
    import numpy as np
    import torch

    from mae.config import FinetuneConfig
    from mae.stages.finetune import mixup_and_criterion

    x, y = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).reshape(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    mixup, _ = mixup_and_criterion(FinetuneConfig(seed=5), 3)
    saved = mixup.state_dict()
    first = mixup(x, y)
    np.random.rand(7)  # the loader drawing from the global stream between two batches changes nothing
    again, _ = mixup_and_criterion(FinetuneConfig(seed=5), 3)
    again.load_state_dict(saved)
    before = np.random.get_state()[1].copy()
    assert all(torch.equal(a, b) for a, b in zip(first, again(x, y), strict=True))
    assert np.array_equal(np.random.get_state()[1], before)  # nor does mixup draw from the global stream
    second = mixup(x, y)
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))  # the stream goes on between batches
