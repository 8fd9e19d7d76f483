"""Faults users meet on long runs: kills, preemption signals, corrupt files, full disks."""

import errno
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from PIL import Image
from safetensors.torch import load_file

import mae
from mae.cli import main
from tests.conftest import make_images

FAST = ["--model.name", "mae_vit_micro_patch8", "--model.img_size", "32", "--loop.progress", "false",
        "--loop.mixed_precision", "no", "--loop.log_every", "1", "--optim.warmup_epochs", "0.5",
        "--optim.lr", "1e-3"]  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    """stderr without advisory warnings (e.g. "warning: data_wait ..." on a slow machine)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]


def run(*args) -> int:
    AcceleratorState._reset_state(True)
    return main(["pretrain", *FAST, *map(str, args)])


# --- corrupt data --------------------------------------------------------------------------------


def _png_header(width: int, height: int) -> bytes:
    """A tiny PNG file whose header claims width x height pixels (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def corrupt_corpus(root: Path) -> tuple[set[str], set[str]]:
    """(good file names, bad file names) written under `root`, every case of the reliability issue."""
    root.mkdir(parents=True, exist_ok=True)
    good = {p.name for p in make_images(root, n=11, nested=False)}
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
    photo.convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray((rng.random((40, 40)) * 65535).astype(np.uint16)).save(root / "gray16.png")
    photo.convert("RGBA").save(root / "rgba.png")
    photo.convert("P").save(root / "palette.gif")
    exif = Image.Exif()
    exif[0x0112] = 6
    photo.save(root / "rotated.jpg", exif=exif.tobytes())
    Image.new("RGB", (1, 1), (9, 9, 9)).save(root / "tiny.png")
    good |= {"cmyk.jpg", "gray16.png", "rgba.png", "palette.gif", "rotated.jpg", "tiny.png"}
    photo.save(root / "full.jpg")
    data = (root / "full.jpg").read_bytes()
    (root / "full.jpg").unlink()
    (root / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (root / "empty.jpg").write_bytes(b"")
    (root / "text.jpg").write_text("just some text")
    photo.save(root / "crc.png")
    raw = bytearray((root / "crc.png").read_bytes())
    raw[-20] ^= 0xFF  # inside the last data chunk: its CRC no longer matches
    (root / "crc.png").write_bytes(bytes(raw))
    (root / "bomb.png").write_bytes(_png_header(100_000, 100_000))
    os.symlink(root / "loop_b.jpg", root / "loop_a.jpg")
    os.symlink(root / "loop_a.jpg", root / "loop_b.jpg")
    photo.save(root / "locked.png")
    os.chmod(root / "locked.png", 0)
    bad = {"truncated.jpg", "empty.jpg", "text.jpg", "crc.png", "bomb.png", "loop_a.jpg", "loop_b.jpg", "locked.png"}
    return good, bad


@pytest.fixture
def deny_locked(monkeypatch):
    """chmod 000 stops every user but root; as root (CI), make the OS refuse it all the same."""
    if os.geteuid() != 0:
        return
    real_open = Image.open

    def open_(fp, *args, **kwargs):
        if str(fp).endswith("locked.png"):
            raise PermissionError(errno.EACCES, "Permission denied", str(fp))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr("mae.data.images.Image.open", open_)


def test_pretraining_survives_a_corrupt_corpus(tmp_path, monkeypatch, deny_locked):
    good, bad = corrupt_corpus(tmp_path / "data")
    from mae.train.tasks import PretrainTask

    seen: set[int] = set()
    forward = PretrainTask.forward

    def recording(self, batch):
        seen.update(batch["index"].tolist())
        return forward(self, batch)

    monkeypatch.setattr(PretrainTask, "forward", recording)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 17 good + 8 bad = 25 files; batches of 5 use every file each epoch; two workers each meet bad files
        assert run("--data.path", tmp_path / "data", "--loop.epochs", 2, "--loop.batch_size", 5,
                   "--data.num_workers", 2, "--output_dir", tmp_path / "run") == 0  # fmt: skip
    messages = [str(w.message) for w in caught if "skipping unreadable image" in str(w.message)]
    for name in bad:
        assert sum(f"/{name}:" in m for m in messages) == 1, (name, messages)  # once, naming the file and why
    assert len(messages) == len(bad)
    assert "DecompressionBomb" in next(m for m in messages if "bomb.png" in m)  # refused from the header alone
    last = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' not in x]
    assert last[-1]["skipped_files"] == len(bad)
    src = mae.data.folder.FolderSource(tmp_path / "data")
    assert {Path(src.name(i)).name for i in seen} == good  # every good file was trained on


def test_knn_survives_a_corrupt_corpus(tmp_path, deny_locked):
    good, bad = corrupt_corpus(tmp_path / "lab" / "a")
    make_images(tmp_path / "lab" / "b", n=8, nested=False, seed=3)
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    AcceleratorState._reset_state(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["knn", "--pretrained", str(enc), "--data.path", str(tmp_path / "lab"), "--data.num_workers", "0",
                     "--output_dir", str(tmp_path / "knn"), "--loop.mixed_precision", "no"]) == 0  # fmt: skip
    messages = [str(w.message) for w in caught if "skipping unreadable image" in str(w.message)]
    assert sorted(Path(m.split(": ")[0].split()[-1]).name for m in messages) == sorted(bad)


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "linprobe", "knn"])
def test_a_corpus_with_no_readable_image_ends_the_run(tmp_path, stage, capsys):
    """Skipping unreadable files must not train (or score) on nothing: when none can be read, the run ends
    with one line, exit 1 in the training loop, exit 2 where features are extracted (probe, k-NN, and the
    fine-tune's starting probe, which reads the data before its loop)."""
    for name in ("a", "b"):
        (tmp_path / "lab" / name).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "lab" / name / f"{i}.png").write_bytes(b"not a png")
    args = ["--data.path", str(tmp_path / "lab"), "--loop.mixed_precision", "no", "--data.num_workers", "0",
            "--output_dir", str(tmp_path / "out")]  # fmt: skip
    if stage == "pretrain":
        args += FAST + ["--loop.batch_size", "2"]
    else:
        enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
        args += ["--pretrained", str(enc)]
        args += [] if stage == "knn" else ["--loop.batch_size", "2", "--loop.progress", "false"]
    AcceleratorState._reset_state(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one per file, checked by the tests above
        code = main([stage, *args])
    err = error_lines(capsys.readouterr().err)
    assert code == (1 if stage == "pretrain" else 2), err
    assert "no image" in err[-1] and "could be read: every file was skipped as unreadable" in err[-1], err[-1]


@pytest.mark.timeout(2 * 300 + 120)  # two launches of up to 300 s each and a k-NN in this process
def test_two_processes_get_through_a_corrupt_corpus(tmp_path):
    """Several processes meet unreadable files apart: a batch with none readable on one process (pretraining
    with half the files bad, two a batch) and evaluation batches of unequal sizes (k-NN) must neither break
    the collectives nor count a sample twice; k-NN gives what one process gives."""
    rng = np.random.default_rng(0)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(mixed / f"g{i}.png")
        (mixed / f"b{i}.png").write_bytes(b"not a png")
    labeled = tmp_path / "lab"
    for name in ("a", "b"):
        make_images(labeled / name, n=10, nested=False, seed=ord(name))
        for i in range(3):
            (labeled / name / f"bad{i}.png").write_bytes(b"not a png")
    enc = mae.export_encoder(mae.create_mae("mae_vit_micro_patch8"), tmp_path / "enc.safetensors")
    common = ["--loop.mixed_precision", "no", "--data.num_workers", "0"]
    pretrain = [
        "pretrain",
        *FAST,
        *common,
        "--data.path",
        str(mixed),
        "--loop.batch_size",
        "2",
        "--loop.epochs",
        "2",
    ]
    knn = ["knn", *common, "--pretrained", str(enc), "--data.path", str(labeled), "--loop.batch_size", "4"]
    for args, out in ((pretrain, "pre"), (knn, "knn2")):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mae",
             *args, "--output_dir", str(tmp_path / out)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    # the batches with no readable image were rerun for no gradient, counted over both processes
    logged = [json.loads(x) for x in (tmp_path / "pre" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "img_per_s" in r]
    assert steps[-1]["step"] == 8 and steps[-1]["skipped_files"] == 8, steps
    # logged every step: a step where one process reran logs the other's loss; where both did, none (null), and
    # the zero gradient is not counted as a non-finite one
    counts = [0] + [r["rerun_batches"] for r in steps]
    added = [after - before for before, after in itertools.pairwise(counts)]
    assert 1 in added and all((r["loss"] is None) == (n == 2) for r, n in zip(steps, added, strict=True)), steps
    assert all(math.isfinite(r["loss"]) for r in steps if r["loss"] is not None) and steps[-1]["nonfinite_steps"] == 0
    AcceleratorState._reset_state(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*knn, "--output_dir", str(tmp_path / "knn1")]) == 0
    one, two = (
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("knn1", "knn2")
    )
    assert one[-1]["samples"] == two[-1]["samples"] and one[-1]["top1"] == two[-1]["top1"]


# --- kills, signals ------------------------------------------------------------------------------

DRIVER = """
import os, signal, sys
{inject}
from mae.cli import main
sys.exit(main(sys.argv[1:]))
"""
ARGS = ["pretrain", *FAST, "--data.num_workers", "0", "--loop.epochs", "3", "--loop.batch_size", "4",
        "--loop.checkpoint_every", "2", "--loop.keep_checkpoints", "2"]  # fmt: skip


def child(out: Path, inject: str = "", args: list[str] | None = None) -> subprocess.CompletedProcess:
    """`mae ARGS --output_dir OUT` in a fresh interpreter, after running `inject` (a fault to plant)."""
    code = DRIVER.format(inject=textwrap.dedent(inject))
    return subprocess.run([sys.executable, "-c", code, *(ARGS if args is None else args), "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(sorted((out / "checkpoints").glob("step_*"))[-1] / "model.safetensors")


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit; else the names and largest differences of those that differ."""
    assert a.keys() == b.keys()
    differ = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{len(differ)} of {len(a)} tensors differ: {sorted(differ.items())[:5]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's weights; while this module's tests run, ARGS names its images (undone after)."""
    root = tmp_path_factory.mktemp("kill")
    make_images(root / "imgs", n=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "ARGS", [*ARGS, "--data.path", str(root / "imgs")])
        proc = child(root / "uninterrupted")
        assert proc.returncode == 0, proc.stderr[-2000:]
        yield final_weights(root / "uninterrupted")


KILLS = {
    "during_a_step": """
        from mae.train.tasks import PretrainTask
        f = PretrainTask.forward
        calls = [0]
        def forward(self, batch):
            calls[0] += 1
            if calls[0] == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            return f(self, batch)
        PretrainTask.forward = forward
    """,
    "during_a_checkpoint_save": """
        import mae.train.checkpoint as c
        f = c._fsync_tree
        calls = [0]
        def fsync(folder):
            calls[0] += 1
            if calls[0] == 3:  # the third save: its files are written, the rename has not happened
                os.kill(os.getpid(), signal.SIGKILL)
            return f(folder)
        c._fsync_tree = fsync
    """,
    "between_epochs": """
        from mae.data.samplers import EpochSampler
        f = EpochSampler.set_epoch
        def set_epoch(self, epoch):
            if epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return f(self, epoch)
        EpochSampler.set_epoch = set_epoch
    """,
}


@pytest.mark.slow
@pytest.mark.parametrize("point", sorted(KILLS))
def test_sigkill_then_rerun_is_bit_identical(tmp_path, reference, point):
    out = tmp_path / "run"
    killed = child(out, KILLS[point])
    assert killed.returncode == -signal.SIGKILL
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts, "a complete checkpoint exists"
    mae.load_pretrained(ckpts[-1])  # the latest complete checkpoint always loads
    resumed = child(out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert_same_tensors(final_weights(out), reference)
    assert not list((out / "checkpoints").glob(".tmp-*"))


SIGTERM_AT_STEP_5 = """
    from mae.train.tasks import PretrainTask
    f = PretrainTask.forward
    calls = [0]
    def forward(self, batch):
        calls[0] += 1
        if calls[0] == 5:
            for _ in range({times}):
                os.kill(os.getpid(), signal.SIGTERM)
        return f(self, batch)
    PretrainTask.forward = forward
"""


@pytest.mark.slow
def test_sigterm_saves_and_exits_0_then_resumes(tmp_path, reference):
    out = tmp_path / "run"
    stopped = child(out, SIGTERM_AT_STEP_5.format(times=1))
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped by signal at step 5" in stopped.stdout and "Run the same command again to resume" in stopped.stdout
    assert (out / "checkpoints" / "step_00000005").is_dir()
    resumed = child(out)
    assert resumed.returncode == 0
    weights = final_weights(out)
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path, reference):
    proc = child(tmp_path / "run", SIGTERM_AT_STEP_5.format(times=2))
    assert proc.returncode == 128 + signal.SIGTERM
    assert not (tmp_path / "run" / "checkpoints" / "step_00000005").exists()


@pytest.mark.slow
def test_sigint_saves_and_exits_0_then_resumes(tmp_path, reference):
    out = tmp_path / "run"
    stopped = child(out, SIGTERM_AT_STEP_5.format(times=1).replace("SIGTERM", "SIGINT"))
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped by signal at step 5" in stopped.stdout
    assert child(out).returncode == 0
    assert_same_tensors(final_weights(out), reference)


@pytest.mark.slow
def test_resume_from_a_named_checkpoint_and_checkpoints_are_pruned(tmp_path, reference):
    out = tmp_path / "run"
    assert child(out, SIGTERM_AT_STEP_5.format(times=1)).returncode == 0
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == ["step_00000004", "step_00000005"]  # --loop.keep_checkpoints 2: step 2's is gone
    resumed = child(out, args=[*ARGS, "--resume", str(out / "checkpoints" / "step_00000004")])
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout and "(step 4," in resumed.stdout
    assert_same_tensors(final_weights(out), reference)  # step 5's checkpoint was not the one read
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000010", "step_00000012"]
    missing = child(out, args=[*ARGS, "--resume", str(tmp_path / "nowhere")])
    assert missing.returncode == 2 and error_lines(missing.stderr) == [
        f"mae pretrain: error: --resume {tmp_path / 'nowhere'}: no such checkpoint; use auto, never or a checkpoint "
        "folder"
    ]


@pytest.mark.slow
@pytest.mark.timeout(3 * 300 + 60)  # three launches of up to 300 s each, beyond the suite's 600 s per test
def test_sigterm_to_one_of_two_processes_stops_both_with_a_checkpoint_then_resumes(tmp_path):
    make_images(tmp_path / "imgs", n=16)
    args = ["pretrain", *FAST, "--data.path", str(tmp_path / "imgs"), "--data.num_workers", "0", "--loop.epochs", "3",
            "--loop.batch_size", "2", "--loop.checkpoint_every", "100"]  # fmt: skip
    driver = DRIVER.format(inject=textwrap.dedent(SIGTERM_AT_STEP_5.format(times=1)).replace(
        "if calls[0] == 5:", "if calls[0] == 5 and os.environ['RANK'] == '1':"))  # fmt: skip
    script = tmp_path / "driver.py"
    script.write_text(driver)

    def launch(out, code):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(code),
               *args, "--output_dir", str(out)]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ,
                              "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip

    plain = tmp_path / "plain.py"
    plain.write_text(DRIVER.format(inject=""))
    assert launch(tmp_path / "whole", plain).returncode == 0
    stopped = launch(tmp_path / "run", script)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped by signal at step" in stopped.stdout
    assert list((tmp_path / "run" / "checkpoints").glob("step_*"))  # the agreed stop saved a checkpoint
    resumed = launch(tmp_path / "run", plain)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert_same_tensors(final_weights(tmp_path / "run"), final_weights(tmp_path / "whole"))


# --- disks ---------------------------------------------------------------------------------------


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    import mae.train.checkpoint as ckpt

    make_images(tmp_path / "imgs", n=16)
    real = ckpt._fsync_tree
    calls = [0]

    def full(folder):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(folder)

    monkeypatch.setattr(ckpt, "_fsync_tree", full)
    code = run("--data.path", tmp_path / "imgs", "--data.num_workers", 0, "--loop.epochs", 2, "--loop.batch_size", 4,
               "--loop.checkpoint_every", 2, "--output_dir", tmp_path / "run")  # fmt: skip
    err = error_lines(capsys.readouterr().err)
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0] and "resume" in err[0]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]
    mae.load_pretrained(tmp_path / "run")


def test_too_little_space_or_an_unwritable_folder_stop_before_training(tmp_path, monkeypatch, capsys):
    make_images(tmp_path / "imgs", n=8)
    (tmp_path / "file").write_text("x")
    assert run("--data.path", tmp_path / "imgs", "--output_dir", tmp_path / "file" / "out") == 2
    assert "--output_dir" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert run("--data.path", tmp_path / "imgs", "--loop.batch_size", 4, "--output_dir", tmp_path / "o") == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "GiB free" in err[0] and "--loop.keep_checkpoints" in err[0]
