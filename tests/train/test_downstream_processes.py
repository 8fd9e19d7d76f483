"""Fine-tuning and the linear probe on two processes against one: the same samples at every step, the same
evaluation counts (uneven last batches included), and the same weights where the maths is the same.

Not bit for bit: DDP averages the two processes' gradients of half batches (an all-reduce, then a division), one
process takes the gradient of the whole batch; the sums run in another order, so the weights agree to float
rounding. The probe's BatchNorm normalizes each process's batch with its own statistics (as the paper's DDP code
does; torch's SyncBatchNorm runs on GPUs only), so two processes of batch B train as one process of batch B with
two accumulation steps, not as one of batch 2B; and DDP keeps rank 0's running statistics, so the folded head
differs in them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mae
from tests.conftest import make_labeled

pytestmark = pytest.mark.slow

COMMON = ["--loop.mixed_precision", "no", "--loop.progress", "false", "--loop.log_every", "1", "--seed", "3",
          "--loop.epochs", "2", "--data.num_workers", "0", "--optim.warmup_epochs", "1"]  # fmt: skip
# Mixup/CutMix draw one mix per process batch and drop path draws per process: off, so both runs draw alike.
FINETUNE = ["finetune", "--model.drop_path", "0", "--aug.mixup", "0", "--aug.cutmix", "0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """24 training images (3 steps of 8 an epoch) and 9 validation images (batches of 4 on 2 processes: 4+4, then
    1 on one process and none on the other)."""
    root = tmp_path_factory.mktemp("procs")
    make_labeled(root / "train", per_class=8)
    make_labeled(root / "val", per_class=3, seed=1)
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), root / "enc.safetensors")
    return ["--pretrained", str(enc), "--data.path", str(root / "train"), "--data.val_path", str(root / "val")]


def launch(out: Path, args: list[str], processes: int) -> list[dict]:
    """`mae ARGS` on `processes` processes (torchrun for two); its metrics lines."""
    front = [sys.executable, "-m", "mae"]
    if processes > 1:
        front = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
                 "-m", "mae"]  # fmt: skip
    proc = subprocess.run([*front, *args, "--output_dir", str(out)], env=ENV, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{processes} process(es)" in proc.stdout
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def split(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines)."""
    return [m for m in lines if "eval" not in m], [m for m in lines if "eval" in m]


def test_finetune_on_two_processes_is_one_process(tmp_path, data):
    one = launch(tmp_path / "one", [*FINETUNE, *COMMON, *data, "--loop.batch_size", "8"], 1)
    two = launch(tmp_path / "two", [*FINETUNE, *COMMON, *data, "--loop.batch_size", "4"], 2)
    (train1, eval1), (train2, eval2) = split(one), split(two)
    assert [m["step"] for m in train1] == [m["step"] for m in train2] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(train1, train2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["lr"] == b["lr"]
    # every validation image counted once on each side, the same predictions
    counts = [[(m["eval"], m["samples"], m["top1"]) for m in lines] for lines in (eval1, eval2)]
    assert counts[0] == counts[1]
    assert {m["samples"] for m in eval1} == {9}
    for a, b in zip(eval1, eval2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
    w1, w2 = (load_file(d / "classifier.safetensors") for d in (tmp_path / "one", tmp_path / "two"))
    assert w1.keys() == w2.keys()
    for k in w1:  # float rounding of the gradient sums, grown by AdamW over 6 steps
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5)


def test_linprobe_on_two_processes_is_one_process_accumulating_two_batches(tmp_path, data):
    probe = ["linprobe", *COMMON, *data, "--loop.batch_size", "4"]
    one = launch(tmp_path / "one", [*probe, "--loop.accum_steps", "2"], 1)
    two = launch(tmp_path / "two", probe, 2)
    (train1, eval1), (train2, eval2) = split(one), split(two)
    assert [m["step"] for m in train1] == [m["step"] for m in train2] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(train1, train2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["lr"] == b["lr"]
    assert [(m["samples"], m["top1"]) for m in eval1] == [(m["samples"], m["top1"]) for m in eval2] == [(9, 100.0)]
    last = [load_file(sorted((tmp_path / d / "checkpoints").glob("step_*"))[-1] / "model.safetensors")
            for d in ("one", "two")]  # fmt: skip
    linear = [k for k in last[0] if k.startswith("1.")]  # the Linear after the BatchNorm ("0.")
    assert linear
    for k in linear:
        torch.testing.assert_close(last[0][k], last[1][k], rtol=1e-4, atol=1e-6)
    # DDP broadcasts rank 0's running statistics: they saw half the batches that one process's saw
    assert not torch.equal(last[0]["0.running_mean"], last[1]["0.running_mean"])
