"""kill -9 and the same command again, as users run it: the default loader workers (2) and precision (`auto`),
gradient accumulation killed between micro-steps, and two processes killed together. Each resumed run ends with
the weights of a run never interrupted, bit for bit. (test_reliability.py kills runs with 0 workers and fp32.)"""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mae.train.accelerator import cpu_has_bf16
from tests.conftest import make_images
from tests.train.test_reliability import DRIVER, assert_same_tensors, child, final_weights

pytestmark = pytest.mark.slow

# The defaults users run with: no --data.num_workers, no --loop.mixed_precision.
USER = ["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--loop.progress", "false",
        "--loop.log_every", "1", "--optim.warmup_epochs", "0.5", "--optim.lr", "1e-3", "--loop.epochs", "3",
        "--loop.checkpoint_every", "2", "--loop.keep_checkpoints", "2"]  # fmt: skip

# SIGKILL at the Nth forward (a micro-step); prints where it landed first (flushed, so the test can read it).
KILL_AT = """
    from accelerate.state import GradientState
    from mae.train.tasks import PretrainTask
    f = PretrainTask.forward
    calls = [0]
    def forward(self, batch):
        calls[0] += 1
        if calls[0] == {n} and os.environ.get("RANK", "0") in {ranks}:
            print(f"killed at micro-step {{calls[0]}}, sync_gradients={{GradientState().sync_gradients}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return f(self, batch)
    PretrainTask.forward = forward
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    make_images(root / "imgs", n=20)  # 20 images: batches of 4 fill 5 a epoch, batches of 2 fill 10
    return root / "imgs"


def kill_resume_compare(tmp_path: Path, args: list[str], micro_step: int) -> str:
    """The uninterrupted run, then a run killed at `micro_step` and the same command again; asserts the final
    weights are equal bit for bit and returns the killed run's output (where the kill landed)."""
    whole = child(tmp_path / "whole", args=args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = child(tmp_path / "run", KILL_AT.format(n=micro_step, ranks='("0",)'), args=args)
    assert killed.returncode == -signal.SIGKILL, (micro_step, killed.stderr[-2000:])
    resumed = child(tmp_path / "run", args=args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_tensors(final_weights(tmp_path / "run"), final_weights(tmp_path / "whole"))
    return killed.stdout + whole.stdout


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_kill_at_a_random_step_with_the_default_workers_and_precision(tmp_path, images, precision):
    """2 loader workers (the default) and `auto` precision (the default: bf16 where this CPU computes in it, else
    fp32), and bf16 asked for by name (emulated where the CPU lacks bf16 instructions): 15 steps, killed at a
    random one after the first checkpoint."""
    args = [*USER, "--data.path", str(images), "--loop.batch_size", "4"]
    if precision != "auto":
        args += ["--loop.mixed_precision", precision]
    step = random.Random().randrange(3, 15)
    out = kill_resume_compare(tmp_path, args, step)
    expected = "bf16" if precision == "bf16" else None
    resolved = re.search(r"precision (\w+)", out).group(1)
    if precision == "auto":  # what `auto` took on this CPU: fp32 ("no") without bf16 instructions
        expected = resolved if cpu_has_bf16() else "no"
    assert resolved == expected, (resolved, out)


def test_kill_mid_accumulation(tmp_path, images):
    """--loop.accum_steps 4 over 10 batches an epoch: optimizer steps of 4, 4 and 2 micro-steps (the last one cut
    short by the epoch's end). Killed at micro-step 17 of 30, the third of step 5 (two gradients accumulated),
    after the checkpoint of step 4: the rerun goes back to step 4 and must redo the partial accumulation."""
    args = [*USER, "--data.path", str(images), "--loop.batch_size", "2", "--loop.accum_steps", "4"]
    out = kill_resume_compare(tmp_path, args, 17)
    assert "killed at micro-step 17, sync_gradients=False" in out, out  # the kill landed mid-accumulation
    assert "3 steps/epoch, 9 steps" in out, out


def test_two_processes_killed_together(tmp_path, images):
    """torchrun's two processes both SIGKILLed at the same random micro-step (a node lost), then the same
    command: the weights of the uninterrupted two-process run."""
    args = [*USER, "--data.path", str(images), "--loop.batch_size", "2", "--data.num_workers", "0"]
    step = random.Random().randrange(3, 15)
    scripts = {}
    for name, inject in (("plain", ""), ("kill", KILL_AT.format(n=step, ranks='("0", "1")'))):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(DRIVER.format(inject=textwrap.dedent(inject)))

    def launch(out: Path, script: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
               *args, "--output_dir", str(out)]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ,
                              "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip

    whole = launch(tmp_path / "whole", scripts["plain"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = launch(tmp_path / "run", scripts["kill"])
    assert killed.returncode != 0 and "exitcode  : -9" in killed.stderr, (step, killed.stderr[-3000:])
    assert killed.stdout.count(f"killed at micro-step {step}") == 2, (step, killed.stdout)
    resumed = launch(tmp_path / "run", scripts["plain"])
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_tensors(final_weights(tmp_path / "run"), final_weights(tmp_path / "whole"))
