"""Two nodes on one machine, started as a cluster starts them (one launcher per node, loopback rendezvous): they
train as one process does, and a node whose --output_dir is not the main process's folder ends the run at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_images
from tests.launch import free_port
from tests.train.test_pretrain import FAST, metrics

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
RUN_S = 120  # a whole tiny run of two nodes on two busy cores; a failure must end far sooner (FAIL_S)
FAIL_S = 60


def torchrun_node(rank: int, port: int) -> list[str]:
    """The node's launcher as on a cluster: c10d rendezvous at the head node (here 127.0.0.1)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
            "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "-m", "mae"]  # fmt: skip


def accelerate_node(rank: int, port: int) -> list[str]:
    """`--multi_gpu` on a machine without GPUs runs torchrun's launcher, and each process joins over gloo."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
            "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mae"]  # fmt: skip


LAUNCHERS = {"torchrun": torchrun_node, "accelerate": accelerate_node}


def run_together(cmds: list[list[str]], logs: Path, timeout: float, envs: list[dict] | None = None) -> list[dict]:
    """Start every command at once (with its own environment from `envs`, else ENV), each in its own process
    group; wait for all of them, up to `timeout`. Returns
    each one's exit status, seconds until it ended and its output. Every process they started is killed at the
    end, whatever happened (a test must not leave a launcher behind)."""
    logs.mkdir(parents=True, exist_ok=True)
    began, procs, results = time.monotonic(), [], []
    try:
        for i, cmd in enumerate(cmds):
            out, err = (open(logs / f"node{i}.{s}", "w") for s in ("out", "err"))  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, env=envs[i] if envs else ENV,
                                           start_new_session=True),
                          out, err))  # fmt: skip
        ended: dict[int, float] = {}
        while len(ended) < len(procs) and time.monotonic() - began < timeout:
            for i, (p, _, _) in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.monotonic() - began
            time.sleep(0.2)
    finally:
        for p, out, err in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            out.close()
            err.close()
    for i, (p, _, _) in enumerate(procs):
        text = {s: (logs / f"node{i}.{s}").read_text() for s in ("out", "err")}
        results.append({"rc": p.returncode if i in ended else None, "s": ended.get(i), **text})
    return results


def pretrain_args(images: Path, out: Path) -> list[str]:
    return ["pretrain", *FAST, "--data.path", str(images), "--loop.epochs", "2", "--loop.batch_size", "4",
            "--output_dir", str(out)]  # fmt: skip


def test_two_nodes_train_as_one_process(tmp_path):
    """torchrun's and accelerate's two-node forms give, bit for bit, the run of one process that accumulates the
    two nodes' batches: DDP scales each process's gradient by 1/2 and sums the two, one process scales each
    micro-batch's loss by 1/2 and adds the second gradient to the first, the same float operations."""
    make_images(tmp_path / "imgs", n=16)
    for name, node in LAUNCHERS.items():
        port = free_port()
        cmds = [[*node(k, port), *pretrain_args(tmp_path / "imgs", tmp_path / name)] for k in (0, 1)]
        nodes = run_together(cmds, tmp_path / f"logs-{name}", RUN_S)
        for n in nodes:
            assert n["rc"] == 0, f"{name}: {n['err'][-3000:]}"
        assert "2 process(es)" in "".join(n["out"] + n["err"] for n in nodes)
    # one thread, as each node has: the thread count changes how a matrix product splits its sums
    one = [sys.executable, "-m", "mae", *pretrain_args(tmp_path / "imgs", tmp_path / "one"), "--loop.accum_steps", "2"]
    (node,) = run_together([one], tmp_path / "logs-one", RUN_S)
    assert node["rc"] == 0, node["err"][-3000:]
    losses = {n: [m["loss"] for m in metrics(tmp_path / n)] for n in ("one", *LAUNCHERS)}
    assert len(losses["one"]) == 4 and losses["torchrun"] == losses["accelerate"] == losses["one"]
    a, b, c = (load_file(tmp_path / n / "encoder.safetensors") for n in ("torchrun", "accelerate", "one"))
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_node_that_does_not_share_the_output_dir_ends_the_run(tmp_path, launcher):
    """Two --output_dir on one machine stand in for each node's own disk: both nodes end, non-zero, within a minute,
    each with the one line that names the folder and says it must be shared; no checkpoint is written."""
    make_images(tmp_path / "imgs", n=16)
    port = free_port()
    node = LAUNCHERS[launcher]
    cmds = [[*node(k, port), *pretrain_args(tmp_path / "imgs", tmp_path / f"disk{k}")] for k in (0, 1)]
    nodes = run_together(cmds, tmp_path / "logs", FAIL_S + 30)
    for k, n in enumerate(nodes):
        assert n["rc"] not in (0, None) and n["s"] < FAIL_S, (k, n["rc"], n["s"], n["err"][-3000:])
        lines = [line for line in n["err"].splitlines() if line.startswith("mae pretrain: error: --output_dir")]
        assert len(lines) == 1 and "must be on storage all nodes share" in lines[0], n["err"][-3000:]
        assert "cannot see the run folder the main process" in lines[0] and "on host" in lines[0]
        assert not (tmp_path / f"disk{k}" / "checkpoints").exists()
        assert not list((tmp_path / f"disk{k}").glob(".shared-*"))  # the main process's marker is removed


def test_two_nodes_finetune_as_one_process(tmp_path):
    """Fine-tuning on 2 nodes x 1 process (torchrun's and accelerate's forms) is, bit for bit, one process that
    accumulates the two nodes' batches (see above). Against one process with the whole batch in one step it agrees
    to float rounding (another summation order): test_downstream_processes.py."""
    import mae
    from tests.conftest import make_labeled

    make_labeled(tmp_path / "lab", per_class=8)
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    args = ["finetune", "--model.drop_path", "0", "--aug.mixup", "0", "--aug.cutmix", "0", "--loop.mixed_precision",
            "no", "--loop.progress", "false", "--loop.log_every", "1", "--loop.epochs", "2", "--loop.batch_size", "4",
            "--data.num_workers", "0", "--optim.warmup_epochs", "1", "--pretrained", str(enc), "--data.path",
            str(tmp_path / "lab"), "--data.val_fraction", "0.3"]  # fmt: skip
    one = [sys.executable, "-m", "mae", *args, "--loop.accum_steps", "2", "--output_dir", str(tmp_path / "one")]
    (node,) = run_together([one], tmp_path / "l1", RUN_S)
    assert node["rc"] == 0, node["err"][-3000:]
    for name, launcher in LAUNCHERS.items():
        port = free_port()
        cmds = [[*launcher(k, port), *args, "--output_dir", str(tmp_path / name)] for k in (0, 1)]
        for n in run_together(cmds, tmp_path / f"logs-{name}", RUN_S):
            assert n["rc"] == 0, f"{name}: {n['err'][-3000:]}"
    ref = load_file(tmp_path / "one" / "classifier.safetensors")
    for name in LAUNCHERS:
        got = load_file(tmp_path / name / "classifier.safetensors")
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), name
        lines = [ln for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if '"img_per_s"' not in ln]
        assert lines == [ln for ln in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()
                         if '"img_per_s"' not in ln]  # fmt: skip
        assert any('"samples": 7' in ln for ln in lines)  # 7 held out of 24: 4 + 3 over 2 processes
