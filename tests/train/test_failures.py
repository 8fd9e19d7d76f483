"""A failure ends the run: one line naming the cause, exit 1, no process left waiting (and no hang)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import make_images

DRIVER = """
import os, signal, sys
{inject}
from mae.cli import main
sys.exit(main(sys.argv[1:]))
"""
ARGS = ["pretrain", "--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--loop.progress", "false",
        "--loop.epochs", "3", "--loop.batch_size", "4", "--optim.warmup_epochs", "1",
        "--data.num_workers", "2"]  # fmt: skip

FAILURES = {
    "a_dataset_item_raises": (
        """
        from mae.data.folder import FolderSource
        f = FolderSource.load
        def load(self, i):
            if i == 5:
                raise KeyError("no such record: 5")
            return f(self, i)
        FolderSource.load = load
        """,
        "KeyError: 'no such record: 5' (in a DataLoader worker)",
    ),
    "the_evaluation_raises": (
        """
        from mae.train.tasks import PretrainTask
        def evaluate(self, epoch, final):
            raise RuntimeError("the preview could not be drawn")
        PretrainTask.evaluate = evaluate
        """,
        "RuntimeError: the preview could not be drawn",
    ),
    "a_worker_is_killed": (
        """
        import torch
        from mae.data.folder import FolderSource
        f = FolderSource.load
        def load(self, i):
            if i == 5 and torch.utils.data.get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            return f(self, i)
        FolderSource.load = load
        """,
        "DataLoader worker",
    ),
}


# What a hang would last: gloo's collectives wait 30 minutes, a DataLoader without a timeout for ever. The bounds
# tell that apart from a run that ends at once, and leave room for load: the slowest machine we test on (an AMD
# EPYC without AVX-512, 2 cores) needs ~10 s for a failing run that imports torch and starts two workers and ~24 s
# for two ranks under torchrun when idle, about 4x that under `-n auto` with a second job; the bounds are ~10x.
FAIL_FAST_S = 120
RANK_LOST_S = 240
LEFT_BEHIND_S = 60  # polled: only a group that never empties waits this long


def start(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd` in its own process group; (result, seconds). The group must be empty afterwards."""
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=2 * RANK_LOST_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run hung: {err[-2000:]}")
    elapsed = time.monotonic() - began
    # the group's last processes may still be exiting: wait for them (polling), but not for ever
    deadline = time.monotonic() + LEFT_BEHIND_S
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"processes of the run were left behind {LEFT_BEHIND_S} s after it ended")
        time.sleep(0.1)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), elapsed


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mae pretrain:")]


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_failure_ends_the_run_with_one_line(tmp_path, case):
    inject, cause = FAILURES[case]
    make_images(tmp_path / "imgs", n=16)
    code = DRIVER.format(inject=textwrap.dedent(inject))
    cmd = [
        sys.executable,
        "-c",
        code,
        *ARGS,
        "--data.path",
        str(tmp_path / "imgs"),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    proc, elapsed = start(cmd)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert elapsed < FAIL_FAST_S  # a failure ends the run: it does not wait for a timeout
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("mae pretrain: failed: ") and cause in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Traceback" in (tmp_path / "o" / "error.log").read_text()  # the details are kept for a bug report


@pytest.mark.slow
def test_one_rank_killed_ends_both(tmp_path):
    make_images(tmp_path / "imgs", n=32)
    script = tmp_path / "driver.py"
    script.write_text(
        DRIVER.format(
            inject=textwrap.dedent("""
                from mae.train.tasks import PretrainTask
                f = PretrainTask.forward
                calls = [0]
                def forward(self, batch):
                    calls[0] += 1
                    if calls[0] == 3 and os.environ.get("RANK") == "1":
                        os.kill(os.getpid(), signal.SIGKILL)
                    return f(self, batch)
                PretrainTask.forward = forward
            """)
        )
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *ARGS, "--data.path", str(tmp_path / "imgs"), "--output_dir", str(tmp_path / "o")]  # fmt: skip
    proc, elapsed = start(cmd)
    assert proc.returncode != 0
    assert elapsed < RANK_LOST_S, proc.stderr[-3000:]
    # the rank left alive reports the lost peer in one line; the killed one could write nothing
    out = tmp_path / "o"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("mae pretrain: failed: "), proc.stderr[-3000:]
    assert lines[0].endswith(f"(traceback in {out / 'error.log'})"), lines
    assert "Traceback" in (out / "error.log").read_text() and not list(out.glob("error-rank*.log"))


def test_output_dir_checks_do_not_race(tmp_path):
    """Processes that start together on one output folder each check it without tripping on the others."""
    from concurrent.futures import ProcessPoolExecutor

    from mae.config import PretrainConfig
    from mae.train.checkpoint import check_output_dir

    cfg = PretrainConfig(output_dir=str(tmp_path / "shared"))
    with ProcessPoolExecutor(2) as pool:
        for _ in range(20):
            list(pool.map(check_output_dir, [cfg] * 40))
    assert sorted(p.name for p in Path(cfg.output_dir).iterdir()) == []


def test_a_mae_folder_in_the_working_directory_loses_no_work(tmp_path):
    """`python -m mae` from the parent of a clone: Python imports ./mae as a namespace package (with an
    editable install, submodules still come from the real one); the run must still write its export."""
    (tmp_path / "mae").mkdir()
    make_images(tmp_path / "imgs", n=8)
    cmd = [sys.executable, "-m", "mae", *ARGS, "--loop.epochs", "1", "--data.path", "imgs", "--output_dir", "out"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "encoder.safetensors").is_file()
