"""scripts/slurm: each node's command line, as the sbatch scripts build it from SLURM's variables, trains across two
"nodes" on this machine; and the batch script's trap turns SLURM's warning signal into a checkpoint, a stop and a
requeue, after which the same command resumes."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_images
from tests.launch import free_port
from tests.train.test_multinode import ENV, RUN_S, pretrain_args, run_together
from tests.train.test_pretrain import metrics

pytestmark = pytest.mark.slow

SLURM = Path(__file__).resolve().parents[1] / "scripts" / "slurm"
LAUNCHERS = ("accelerate", "torchrun")


def fake_slurm(bin_dir: Path) -> Path:
    """`scontrol` that names 127.0.0.1 as every node and logs its calls; `srun` that runs its command here, once."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "scontrol.log"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1 $2" = "show hostnames" ] && '
                                      'echo 127.0.0.1 && echo 127.0.0.2\nexit 0\n')  # fmt: skip
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    return log


def slurm_env(bin_dir: Path, nodes: int, node: int, port: int) -> dict:
    return {**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node),
            "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "4242", "MAE_PORT": str(port),
            "MAE_PROCS_PER_NODE": "1", "MAE_PYTHON": sys.executable,
            "SLURM_SUBMIT_DIR": str(SLURM.parents[1])}  # fmt: skip


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_nodes_command_trains_across_two_nodes(tmp_path, launcher):
    sbatch = (SLURM / f"{launcher}.sbatch").read_text()
    assert f'bash "$node" {launcher} "$@"' in sbatch and "#SBATCH --requeue" in sbatch  # the line run below
    log = fake_slurm(tmp_path / "bin")
    make_images(tmp_path / "imgs", n=16)
    port = free_port()
    cmd = ["bash", str(SLURM / "node.sh"), launcher, *pretrain_args(tmp_path / "imgs", tmp_path / "run")]
    nodes = run_together(
        [cmd, cmd], tmp_path / "logs", RUN_S, [slurm_env(tmp_path / "bin", 2, k, port) for k in (0, 1)]
    )
    assert [n["rc"] for n in nodes] == [0, 0], [(n["rc"], n["err"][-2000:]) for n in nodes]
    assert "2 process(es)" in "".join(n["out"] + n["err"] for n in nodes)
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert (tmp_path / "run" / "encoder.safetensors").is_file()
    assert log.read_text().splitlines() == ["show hostnames gpu[01-02]"] * 2  # the head node came from the list


def test_the_warning_signal_checkpoints_stops_and_requeues_then_the_same_command_resumes(tmp_path):
    log = fake_slurm(tmp_path / "bin")
    make_images(tmp_path / "imgs", n=16)
    args = [
        *pretrain_args(tmp_path / "imgs", tmp_path / "run"),
        "--loop.epochs",
        "40",
        "--loop.checkpoint_every",
        "1000",
    ]
    cmd = ["bash", str(SLURM / "torchrun.sbatch"), *args]
    env = slurm_env(tmp_path / "bin", 1, 0, free_port())
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_S
        while time.monotonic() < deadline and not (tmp_path / "run" / "metrics.jsonl").is_file():
            time.sleep(0.2)
        while time.monotonic() < deadline and not metrics(tmp_path / "run"):  # the loop runs: its stop handler is set
            time.sleep(0.2)
        os.kill(job.pid, signal.SIGUSR1)  # SLURM's --signal=B:USR1@120: to the batch shell only
        out, _ = job.communicate(timeout=RUN_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone when the job ended as it should
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert job.returncode == 0, out[-3000:]
    assert "stopped by signal at step" in out and "requeue 4242" in log.read_text(), out[-3000:]
    stopped = metrics(tmp_path / "run")[-1]["step"]
    assert stopped > 0 and (tmp_path / "run" / "checkpoints" / f"step_{stopped:08d}").is_dir()
    again = subprocess.run(cmd, env={**env, "MAE_PORT": str(free_port())}, capture_output=True, text=True,
                           timeout=RUN_S, start_new_session=True)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / f'step_{stopped:08d}'}" in again.stdout + again.stderr
    steps = [m["step"] for m in metrics(tmp_path / "run")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > stopped  # on from the checkpoint, to the end
