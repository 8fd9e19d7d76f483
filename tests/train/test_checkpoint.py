"""Checkpoint writing and reading (mae/train/checkpoint.py) in one process, without training: what a checkpoint
folder holds, which ones are kept, what a failed save leaves, which checkpoint a run resumes from, and the checks
on the output folder. The end-to-end kill and resume tests are in test_reliability.py and test_failures.py."""

import os
import shutil
import stat
import tempfile
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from mae.config import KnnConfig, PretrainConfig, to_dict
from mae.errors import ConfigError
from mae.run_folder import checkpoint_dir, list_checkpoints, partial_checkpoint_dir
from mae.train import checkpoint as ckpt


@pytest.fixture
def accelerator():
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(True)


def prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model.register_buffer("running", torch.arange(4.0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return accelerator.prepare(model, opt)


def save(accelerator, out, step, keep=2, process_state=None):
    return ckpt.save_checkpoint(accelerator, out, step, {"step": step, "epoch": 1}, "seed: 7\n", keep, process_state)


def test_a_checkpoint_holds_the_state_where_the_loop_was_and_its_config(tmp_path, accelerator):
    model, _ = prepared(accelerator)
    folder = save(accelerator, tmp_path, 5, process_state={"offset": 3})
    assert folder == checkpoint_dir(tmp_path, 5) and folder.is_dir()
    assert ckpt.load_loop_state(folder) == {"step": 5, "epoch": 1}
    assert (folder / "config.yaml").read_text() == "seed: 7\n"
    assert ckpt.load_process_state(folder, 0) == {"offset": 3}
    assert list(folder.glob("*.safetensors"))  # Accelerate's model file, in safetensors
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(folder))
    assert torch.equal(model.weight, weight)


def test_without_a_process_state_none_is_written_and_reading_it_names_the_file_and_the_way_out(tmp_path, accelerator):
    prepared(accelerator)
    folder = save(accelerator, tmp_path, 1)
    assert not list(folder.glob("stream_state_rank*.json"))
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load_process_state(folder, 3)
    assert str(e.value) == (
        f"{folder / 'stream_state_rank3.json'}: this checkpoint has no stream position for process 3 (was it saved by "
        "a run with another number of processes?); resume with the same processes, or pass --resume never"
    )


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_keep_checkpoints_stay_and_stale_partial_folders_go(tmp_path, accelerator, keep):
    prepared(accelerator)
    stale = partial_checkpoint_dir(tmp_path, 99)
    stale.mkdir(parents=True)
    for step in (10, 20, 30, 40):
        save(accelerator, tmp_path, step, keep=keep)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{s:08d}" for s in (10, 20, 30, 40)[-keep:]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f"step_{s:08d}" for s in (10, 20, 30, 40)[-keep:]
    ]  # no .tmp-* left


def test_a_partial_folder_of_the_same_step_left_by_a_kill_is_replaced(tmp_path, accelerator):
    prepared(accelerator)
    partial = partial_checkpoint_dir(tmp_path, 5)
    partial.mkdir(parents=True)
    (partial / "junk").write_text("half a checkpoint")
    folder = save(accelerator, tmp_path, 5)
    assert not (folder / "junk").exists() and not partial.exists()


def test_old_checkpoints_that_cannot_be_deleted_do_not_fail_a_save(tmp_path, accelerator, monkeypatch):
    """On storage where deleting fails (busy files on a network share), a save still completes: clearing old and
    partial folders is best effort; and a failed save reports its own error, not the clean-up's."""
    prepared(accelerator)
    save(accelerator, tmp_path, 1, keep=1)
    real_rmtree = shutil.rmtree

    def undeletable(path, ignore_errors=False, **kw):
        if "checkpoints" in str(path) and not ignore_errors:
            raise OSError(16, "Device or resource busy")
        if "checkpoints" not in str(path):
            real_rmtree(path, ignore_errors=ignore_errors, **kw)

    monkeypatch.setattr(shutil, "rmtree", undeletable)
    partial_checkpoint_dir(tmp_path, 0).mkdir()
    assert save(accelerator, tmp_path, 2, keep=1) == checkpoint_dir(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]

    def full_disk(path, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(accelerator, "save_state", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save(accelerator, tmp_path, 3, keep=1)


def test_the_same_step_saved_twice_is_replaced(tmp_path, accelerator):
    model, _ = prepared(accelerator)
    save(accelerator, tmp_path, 7)
    (checkpoint_dir(tmp_path, 7) / "leftover").write_text("from the first save")
    with torch.no_grad():
        model.weight.add_(1)
    save(accelerator, tmp_path, 7)
    folder = checkpoint_dir(tmp_path, 7)
    assert not (folder / "leftover").exists() and [p.name for p in list_checkpoints(tmp_path)] == ["step_00000007"]


def test_a_failed_save_removes_its_partial_folder_and_keeps_the_complete_ones(tmp_path, accelerator, monkeypatch):
    prepared(accelerator)
    save(accelerator, tmp_path, 1)
    before = sorted(p.name for p in checkpoint_dir(tmp_path, 1).iterdir())

    def full_disk(path, **kw):
        (Path(path) / "half_written").write_text("x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(accelerator, "save_state", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save(accelerator, tmp_path, 2)
    assert not partial_checkpoint_dir(tmp_path, 2).exists() and not checkpoint_dir(tmp_path, 2).exists()
    assert sorted(p.name for p in checkpoint_dir(tmp_path, 1).iterdir()) == before


def test_every_file_is_flushed_before_the_rename_and_follows_the_umask(tmp_path, accelerator, monkeypatch):
    prepared(accelerator)
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    old = os.umask(0o027)
    try:
        folder = save(accelerator, tmp_path, 3, process_state={"offset": 0})
    finally:
        os.umask(old)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    tmp = partial_checkpoint_dir(tmp_path, 3)
    assert sorted(synced) == sorted(str(tmp / p.relative_to(folder)) for p in files)  # each file, in the tmp folder
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o640}  # safetensors' 0600 widened to the umask's


def test_checkpoint_bytes_counts_weights_buffers_and_the_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # 8 float32 weights: 32 bytes
    model.register_buffer("running", torch.zeros(4, dtype=torch.float64))  # 32 bytes
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert ckpt.checkpoint_bytes(model, opt) == 32 + 32 + 2 * 32  # moments not yet made: counted as two copies
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    assert state > 2 * 32  # exp_avg, exp_avg_sq and the step counters
    assert ckpt.checkpoint_bytes(model, opt) == 32 + 32 + state


Usage = namedtuple("Usage", "total used free")


def test_disk_space_refuses_a_start_the_checkpoints_cannot_fit(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    need = ckpt.checkpoint_bytes(model, opt) * 3  # keep 2, plus the one being written

    def disk(free):
        return lambda path: Usage(10**13, 0, free) if Path(path) == tmp_path else pytest.fail(f"asked about {path}")

    monkeypatch.setattr(shutil, "disk_usage", disk(need))
    ckpt.check_disk_space(tmp_path, model, opt, keep=2)  # exactly enough
    monkeypatch.setattr(shutil, "disk_usage", disk(need - 1))
    with pytest.raises(ConfigError):
        ckpt.check_disk_space(tmp_path, model, opt, keep=2)
    monkeypatch.setattr(ckpt, "checkpoint_bytes", lambda m, o: 2 * 2**30)  # 2 GiB a checkpoint: 6 GiB needed
    monkeypatch.setattr(shutil, "disk_usage", disk(int(5.5 * 2**30)))
    with pytest.raises(ConfigError) as e:
        ckpt.check_disk_space(tmp_path, model, opt, keep=2)
    assert str(e.value) == (
        f"--output_dir {tmp_path}: 5.50 GiB free, but 2 checkpoints plus the one being written need 6.00 GiB; free "
        "some space, lower --loop.keep_checkpoints, or pick another folder"
    )


def test_the_output_folder_is_made_and_tried_and_left_clean(tmp_path, monkeypatch):
    tried = []
    real_mkstemp = tempfile.mkstemp

    def mkstemp(**kw):
        tried.append(Path(kw["dir"]))
        return real_mkstemp(**kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    cfg = PretrainConfig(output_dir=str(tmp_path / "a" / "b"))
    ckpt.check_output_dir(cfg)
    assert Path(cfg.output_dir).is_dir() and list(Path(cfg.output_dir).iterdir()) == []
    assert tried == [Path(cfg.output_dir)]  # a file was written in the folder itself
    ckpt.check_output_dir(KnnConfig(output_dir=str(tmp_path / "knn")))  # a stage without checkpoints (no --resume)


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(
        ConfigError, match=rf"^--output_dir {blocker}/out: cannot write there \(Not a directory\); choose"
    ):
        ckpt.check_output_dir(PretrainConfig(output_dir=str(blocker / "out")))


def test_resume_names_a_checkpoint_that_is_not_there(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"^--resume {missing}: no such checkpoint; use auto, never or a checkpoint"):
        ckpt.check_output_dir(PretrainConfig(output_dir=str(tmp_path / "o"), resume=str(missing)))
    for resume in ("auto", "never", str(tmp_path)):
        ckpt.check_output_dir(PretrainConfig(output_dir=str(tmp_path / "o"), resume=resume))


def fake_checkpoint(out: Path, step: int, cfg: PretrainConfig) -> Path:
    folder = checkpoint_dir(out, step)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return folder


def test_which_checkpoint_a_run_resumes_from(tmp_path):
    cfg = PretrainConfig(output_dir=str(tmp_path))
    assert ckpt.find_resume_checkpoint(cfg) is None  # auto, nothing saved yet
    first, last = fake_checkpoint(tmp_path, 100, cfg), fake_checkpoint(tmp_path, 1000, cfg)
    assert ckpt.find_resume_checkpoint(cfg) == last  # auto: the newest (by step, not by name)
    fake_checkpoint(tmp_path, 20, cfg)
    assert ckpt.find_resume_checkpoint(cfg) == last
    assert ckpt.find_resume_checkpoint(PretrainConfig(output_dir=str(tmp_path), resume=str(first))) == first
    assert ckpt.find_resume_checkpoint(PretrainConfig(output_dir=str(tmp_path), resume="never")) is None


def test_a_longer_run_or_another_folder_resumes_but_another_config_is_refused_naming_each_change(tmp_path):
    saved = PretrainConfig(output_dir=str(tmp_path / "old"))
    folder = fake_checkpoint(tmp_path, 10, saved)
    longer = replace(saved, output_dir=str(tmp_path / "new"), resume=str(folder), loop=replace(saved.loop, epochs=1600))
    assert ckpt.find_resume_checkpoint(longer) == folder
    changed = replace(saved, seed=5, resume=str(folder), optim=replace(saved.optim, blr=0.1))
    with pytest.raises(ConfigError) as e:
        ckpt.find_resume_checkpoint(changed)
    assert str(e.value) == (
        f"--resume {folder}: {folder} was trained with a different config (optim.blr: 0.00015 -> 0.1, seed: 0 -> 5); "
        "restore those options, or pass --resume never (or a new --output_dir) to start over"
    )


def test_a_checkpoint_config_with_an_option_the_run_lacks_is_a_change(tmp_path):
    cfg = PretrainConfig(output_dir=str(tmp_path))
    folder = fake_checkpoint(tmp_path, 10, cfg)
    (folder / "config.yaml").write_text((folder / "config.yaml").read_text() + "extra: 1\n")
    with pytest.raises(ConfigError, match=r"\(extra: 1 -> None\)"):
        ckpt.find_resume_checkpoint(cfg)
