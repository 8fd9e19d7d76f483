"""The training loop (mae/train/loop.py) in this process, on a toy task and loader, against a loop written out by
hand: the steps and their weights, accumulation, clipping, the lr of each group, non-finite steps, unreadable
batches (one process and, through a stand-in that reports two, the rerun for no gradient), the log lines, the
evaluations, the checkpoints, resume, stop signals and a full disk. The stages' child-process tests run the same
loop end to end; these reach each branch in milliseconds."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from dataclasses import asdict

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from mae.config import LoopConfig
from mae.errors import TrainingError
from mae.run_folder import checkpoint_dir, list_checkpoints
from mae.train import loop as loop_module
from mae.train.loop import LoopState, fit
from mae.train.optim import Schedule, apply_lr

SCHEDULE = Schedule(base_lr=0.05, min_lr=0.001, warmup_steps=2, total_steps=6)
LOG_KEYS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "img_per_s",
    "nonfinite_steps",
    "skipped_files",
    "rerun_batches",
    "data_wait",
}


def make_batches(n, bad=(), unreadable=()):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        x, y = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
        batch = {"id": i, "image": None if i in unreadable else x, "target": y}
        if i in unreadable:
            batch["bad"] = [(f"file{i}.png", "cannot identify image")]
        batches.append(batch)
    for i in bad:
        batches[i]["scale"] = math.inf
    return batches


class ToyTask:
    def __init__(self, model, hook=None, result=None):
        self.model, self.hook, self.steps, self.evals, self.lrs, self.forwards = model, hook, 0, [], [], []
        self.result = {"eval": "val", "loss": 0.5, "top1": 50.0, "samples": 4} if result is None else result
        self.optimizer = None

    def forward(self, batch):
        self.forwards.append(batch["id"])
        loss = ((self.model(batch["image"]) - batch["target"]) ** 2).mean()
        return {"loss": loss * batch.get("scale", 1.0)}

    def after_step(self):
        self.steps += 1
        self.lrs.append([g["lr"] for g in self.optimizer.param_groups])
        if self.hook:
            self.hook(self.steps)

    def evaluate(self, epoch, final):
        self.evals.append((epoch, final))
        return self.result


class ToyLoader:
    num_workers = 0

    def __init__(self, batches):
        self.batches, self.calls = batches, []

    def __len__(self):
        return len(self.batches)

    def epoch_batches(self, epoch, skip):
        self.calls.append((epoch, skip))
        yield from self.batches[skip:]

    def state_dict(self):
        return {"position": len(self.calls)}


class TwoProcesses:
    """This process's Accelerator, reporting two processes: the loop takes its several-process branches (the rerun
    batch, the agreed stop); the collectives of one process return their input."""

    num_processes = 2

    def __init__(self, accelerator):
        self._acc = accelerator

    def __getattr__(self, name):
        return getattr(self._acc, name)

    def check_trigger(self):
        self.triggers_read = getattr(self, "triggers_read", 0) + 1
        return self._acc.check_trigger()


def model_and_optimizer(groups=False):
    """A linear model and plain SGD; `groups`: weight and bias in groups of lr scale 1 and 0.5 (True), or of scale 1
    and none given ("unscaled")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if groups == "unscaled":
        params = [{"params": [model.weight], "lr_scale": 1.0}, {"params": [model.bias]}]
    elif groups:
        params = [{"params": [model.weight], "lr_scale": 1.0}, {"params": [model.bias], "lr_scale": 0.5}]
    else:
        params = model.parameters()
    return model, torch.optim.SGD(params, lr=0.0)


@pytest.fixture
def accelerator():
    def make(accum=1):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True, gradient_accumulation_steps=accum)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_fit(
    tmp_path,
    acc,
    batches,
    *,
    epochs=2,
    accum=1,
    clip=None,
    groups=False,
    state=None,
    wrap=None,
    loader=ToyLoader,
    **loop,
):
    tmp_path.mkdir(parents=True, exist_ok=True)
    model, opt = model_and_optimizer(groups)
    model, opt = acc.prepare(model, opt)
    task = ToyTask(model, loop.pop("hook", None), loop.pop("result", None))
    task.optimizer = opt
    loader = loader(batches)
    options = {"epochs": epochs, "accum_steps": accum, "log_every": 2, "checkpoint_every": 4, "eval_every": 1}
    cfg = LoopConfig(**{**options, "progress": False, **loop})
    state = state or LoopState()
    fit(
        task,
        accelerator=wrap(acc) if wrap else acc,
        loader=loader,
        optimizer=opt,
        schedule=SCHEDULE,
        loop=cfg,
        output_dir=tmp_path,
        config_yaml="run: toy\n",
        state=state,
        clip_grad=clip,
    )
    return model, task, loader, state


def by_hand(batches, *, epochs=2, accum=1, clip=None, groups=False, rerun=()):
    """The loop written out: each micro-batch's loss / accum backpropagated, clipped, stepped at the step's lr (x the
    group's scale) unless the gradient norm is not finite. Returns the weights and each log window's mean loss."""
    model, opt = model_and_optimizer(groups)
    step, losses, windows = 0, [], []
    for _ in range(epochs):
        for i, batch in enumerate(batches):
            if batch["image"] is not None:
                loss = ((model(batch["image"]) - batch["target"]) ** 2).mean() * batch.get("scale", 1.0)
                (loss / accum).backward()
                if math.isfinite(loss.item()):
                    losses.append(loss.item())
            if (i + 1) % accum == 0:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)
                apply_lr(opt, SCHEDULE.lr(step))
                if torch.isfinite(norm):
                    opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step % 2 == 0:
                    windows.append(sum(losses) / len(losses) if losses else None)
                    losses = []
    return model, windows


def read_metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("accum", "clip"), [(1, None), (2, None), (2, 0.05)])
def test_the_weights_are_those_of_the_loop_written_out(tmp_path, accelerator, accum, clip):
    batches = make_batches(6 if accum == 1 else 12)
    model, task, loader, state = run_fit(tmp_path, accelerator(accum), batches, accum=accum, clip=clip)
    reference, windows = by_hand(batches, accum=accum, clip=clip)
    steps = len(batches) // accum * 2
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert asdict(state) == {
        "step": steps,
        "epoch": 2,
        "batch_in_epoch": 0,
        "nonfinite_steps": 0,
        "bad_files": [],
        "rerun_batches": 0,
    }
    assert task.steps == steps and loader.calls == [(0, 0), (1, 0)]
    assert model.weight.grad is None and model.bias.grad is None  # zero_grad(set_to_none=True): no stale zeros
    assert [lrs[0] for lrs in task.lrs] == [SCHEDULE.lr(s) for s in range(steps)]
    logs = [r for r in read_metrics(tmp_path) if "img_per_s" in r]
    assert [r["step"] for r in logs] == list(range(2, steps + 1, 2))
    for record, loss in zip(logs, windows, strict=True):
        assert set(record) == LOG_KEYS
        assert record["loss"] == pytest.approx(loss, rel=1e-6)
        assert record["lr"] == SCHEDULE.lr(record["step"] - 1)
        assert record["epoch"] == round(record["step"] / (steps // 2), 4)
        assert (record["nonfinite_steps"], record["skipped_files"], record["rerun_batches"]) == (0, 0, 0)
        assert record["img_per_s"] > 0 and 0 <= record["data_wait"] <= 1
    assert task.evals == [(1, False), (2, True)]
    evals = [r for r in read_metrics(tmp_path) if "top1" in r]
    assert evals == [{"step": steps // 2, "epoch": 1, **task.result}, {"step": steps, "epoch": 2, **task.result}]


def test_checkpoints_every_n_steps_and_at_the_end_keeping_the_newest(tmp_path, accelerator):
    _, _, _, state = run_fit(tmp_path, accelerator(), make_batches(5), checkpoint_every=3, keep_checkpoints=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009", "step_00000010"]  # 3 and 6 dropped
    saved = json.loads((checkpoint_dir(tmp_path, 10) / "loop_state.json").read_text())
    assert saved == asdict(state) and (checkpoint_dir(tmp_path, 10) / "config.yaml").read_text() == "run: toy\n"


def test_the_last_step_saved_by_the_period_is_not_saved_again(tmp_path, accelerator, monkeypatch):
    saved = []
    real = loop_module.save_checkpoint
    monkeypatch.setattr(loop_module, "save_checkpoint", lambda *a, **k: saved.append(a[2]) or real(*a, **k))
    run_fit(tmp_path, accelerator(), make_batches(4), checkpoint_every=4)
    assert saved == [4, 8]


def test_evaluations_every_n_epochs_and_at_the_end(tmp_path, accelerator, capsys):
    _, task, _, _ = run_fit(tmp_path, accelerator(), make_batches(2), epochs=5, eval_every=2)
    assert task.evals == [(2, False), (4, False), (5, True)]
    assert "epoch 5/5: val loss 0.5000, top1 50.00% (4 images)" in capsys.readouterr().out
    _, task, _, _ = run_fit(tmp_path, accelerator(), make_batches(2), epochs=3, eval_every=0)
    assert task.evals == [(3, True)]


def test_an_empty_evaluation_writes_no_line_and_a_preview_is_named(tmp_path, accelerator, capsys):
    run_fit(tmp_path, accelerator(), make_batches(2), epochs=1, result={})
    assert all("eval" not in r for r in read_metrics(tmp_path)) and "epoch 1/1" not in capsys.readouterr().out
    unnamed = {"loss": 0.5, "top5": 90.0, "knn_top1": 80.0, "knn_top5": 95.0}
    run_fit(tmp_path, accelerator(), make_batches(2), epochs=1, result=unnamed)
    assert "epoch 1/1: eval loss 0.5000, top5 90.00%, knn top1 80.00%, knn top5 95.00%\n" in capsys.readouterr().out
    preview = {"eval": "recon", "loss": 0.25, "miou": 12.5, "pixel_acc": 80.0, "preview": "recon.png"}
    run_fit(tmp_path, accelerator(), make_batches(2), epochs=1, result=preview)
    assert "epoch 1/1: recon loss 0.2500, miou 12.50%, pixel acc 80.00% (recon.png)" in capsys.readouterr().out


def test_each_group_gets_the_step_lr_times_its_scale_and_the_log_lists_them(tmp_path, accelerator):
    batches = make_batches(4)
    model, task, _, _ = run_fit(tmp_path, accelerator(), batches, groups=True)
    reference, _ = by_hand(batches, groups=True)
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert task.lrs == [[SCHEDULE.lr(s), SCHEDULE.lr(s) * 0.5] for s in range(8)]
    logs = [r for r in read_metrics(tmp_path) if "lr" in r]
    assert [r["group_lrs"] for r in logs] == [[r["lr"], r["lr"] * 0.5] for r in logs]
    run_fit(tmp_path / "one", accelerator(), batches)
    assert all("group_lrs" not in r for r in read_metrics(tmp_path / "one"))
    run_fit(tmp_path / "unscaled", accelerator(), batches, groups="unscaled")  # a group without a scale: 1
    assert all("group_lrs" not in r for r in read_metrics(tmp_path / "unscaled"))


def test_a_nonfinite_loss_skips_its_step_and_is_left_out_of_the_logged_loss(tmp_path, accelerator):
    batches = make_batches(4, bad=(1,))
    model, _, _, state = run_fit(tmp_path, accelerator(), batches)
    reference, windows = by_hand(batches)
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    logs = [r for r in read_metrics(tmp_path) if "lr" in r]
    assert [r["nonfinite_steps"] for r in logs] == [1, 1, 2, 2] and state.nonfinite_steps == 2
    assert [r["loss"] for r in logs] == pytest.approx(windows, rel=1e-6)


def test_too_many_nonfinite_steps_in_a_row_stop_the_run_keeping_the_checkpoints(tmp_path, accelerator):
    with pytest.raises(TrainingError) as error:
        run_fit(tmp_path, accelerator(), make_batches(4, bad=(2, 3)), max_nonfinite_steps=2)
    assert str(error.value) == (
        f"2 non-finite losses in a row at step 4; the last good checkpoint is kept in {tmp_path}/checkpoints. Lower "
        "--optim.blr, set --optim.clip_grad, or try --loop.mixed_precision no"
    )
    with pytest.raises(TrainingError, match="3 non-finite losses in a row at step 4"):  # counted across log lines
        run_fit(tmp_path, accelerator(), make_batches(4, bad=(1, 2, 3)), max_nonfinite_steps=3)
    run_fit(tmp_path, accelerator(), make_batches(4, bad=(2, 3)), max_nonfinite_steps=3)  # 2 < 3: goes on


def test_a_batch_with_no_readable_image_trains_on_nothing_and_its_files_are_named(tmp_path, accelerator):
    batches = make_batches(4, unreadable=(1,))
    with pytest.warns(UserWarning, match="skipping unreadable image file1.png: cannot identify image"):
        model, task, _, state = run_fit(tmp_path, accelerator(), batches)
    reference, windows = by_hand(batches)
    assert torch.equal(model.weight, reference.weight) and task.forwards == [0, 2, 3] * 2  # nothing to run on
    logs = [r for r in read_metrics(tmp_path) if "lr" in r]
    assert [r["skipped_files"] for r in logs] == [1] * 4 and state.bad_files == ["file1.png"]
    assert [r["loss"] for r in logs] == pytest.approx(windows, rel=1e-6) and state.rerun_batches == 0


@pytest.mark.parametrize("batches", [1, 2])
def test_an_epoch_with_no_readable_image_is_one_line(tmp_path, accelerator, batches):
    with pytest.raises(TrainingError) as error:
        with pytest.warns(UserWarning):
            run_fit(tmp_path, accelerator(), make_batches(batches, unreadable=range(batches)))
    assert str(error.value) == (
        f"no image of epoch 1 could be read: every file was skipped as unreadable ({batches} warned above, e.g. "
        "file0.png); check --data.path (and --data.image_column)"
    )
    unnamed = make_batches(2, unreadable=(0, 1))
    for batch in unnamed:
        del batch["bad"]
    with pytest.raises(TrainingError, match=r"\(0 warned above, e.g. \?\); check --data.path"):
        run_fit(tmp_path / "unnamed", accelerator(), unnamed)


def test_an_epoch_ending_on_an_unreadable_batch_trains_on_the_others(tmp_path, accelerator):
    with pytest.warns(UserWarning, match="file3.png"):
        _, _, _, state = run_fit(tmp_path, accelerator(), make_batches(4, unreadable=(3,)))
    assert state.step == 8 and state.bad_files == ["file3.png"]


def test_resuming_at_the_end_of_an_epoch_reads_no_batch_and_goes_on(tmp_path, accelerator):
    state = LoopState(step=4, epoch=0, batch_in_epoch=4)  # saved after the epoch's last batch, before its end
    _, task, loader, state = run_fit(tmp_path, accelerator(), make_batches(4), state=state)
    assert loader.calls == [(0, 4), (1, 0)] and state.step == 8 and task.evals == [(1, False), (2, True)]


class SlowLoader(ToyLoader):
    def epoch_batches(self, epoch, skip):
        for batch in super().epoch_batches(epoch, skip):
            time.sleep(0.1)
            yield batch


def test_the_time_waiting_for_batches_is_logged_as_a_share_of_the_window(tmp_path, accelerator):
    run_fit(tmp_path, accelerator(), make_batches(4), epochs=1, log_every=4, loader=SlowLoader)
    (record,) = [r for r in read_metrics(tmp_path) if "data_wait" in r]
    assert 0.6 < record["data_wait"] <= 1  # four waits of 0.1 s in a window of little else


def test_on_several_processes_an_unreadable_batch_reruns_the_last_for_no_gradient(tmp_path, accelerator):
    batches = make_batches(4, unreadable=(2,))
    with pytest.warns(UserWarning, match="file2.png"):
        model, task, _, state = run_fit(tmp_path, accelerator(), batches, wrap=TwoProcesses)
    reference, windows = by_hand(batches)
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)
    assert task.forwards == [0, 1, 1, 3] * 2 and state.nonfinite_steps == 0  # batch 1 again, its loss x 0
    logs = [r for r in read_metrics(tmp_path) if "lr" in r]
    assert [r["rerun_batches"] for r in logs] == [0, 1, 1, 2] and state.rerun_batches == 2
    assert [r["loss"] for r in logs] == pytest.approx(windows, rel=1e-6)
    with pytest.raises(TrainingError) as error:
        run_fit(tmp_path, accelerator(), make_batches(2, unreadable=(0,)), wrap=TwoProcesses)
    assert str(error.value) == (
        "process 0 could read none of the images of its first batch, so it cannot take part in the step (the others "
        "wait on it); fix or remove the unreadable files warned above"
    )
    with pytest.warns(UserWarning):
        run_fit(tmp_path / "two", accelerator(), make_batches(4, unreadable=(1, 2)), wrap=TwoProcesses, log_every=4)
    assert [r["rerun_batches"] for r in read_metrics(tmp_path / "two") if "lr" in r] == [
        2,
        3,
        4,
    ]  # logs at 4, 6 (the schedule's end), 8


def test_resume_starts_at_the_saved_batch_of_the_saved_epoch(tmp_path, accelerator):
    state = LoopState(step=3, epoch=1, batch_in_epoch=1)
    _, task, loader, state = run_fit(tmp_path, accelerator(), make_batches(4), state=state)
    assert loader.calls == [(1, 1)] and task.steps == 3 and state.step == 6 and state.epoch == 2
    assert task.lrs[0][0] == SCHEDULE.lr(3)


@pytest.mark.parametrize("wrap", [None, TwoProcesses])
def test_a_stop_signal_saves_at_the_next_step_boundary_and_exits(tmp_path, accelerator, capsys, wrap):
    def hook(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    made, before = [], signal.getsignal(signal.SIGTERM)
    keep = (lambda acc: made.append(wrap(acc)) or made[-1]) if wrap else None
    with pytest.raises(SystemExit) as stop:
        run_fit(tmp_path, accelerator(), make_batches(4), hook=hook, wrap=keep, checkpoint_every=100)
    at = 3 if wrap is None else 4  # several processes agree at log steps (every 2), through Accelerate's trigger
    assert [m.triggers_read for m in made] == ([] if wrap is None else [2])
    assert signal.getsignal(signal.SIGTERM) is before  # the handler the loop found is back
    assert stop.value.code == 0 and [p.name for p in list_checkpoints(tmp_path)] == [f"step_{at:08d}"]
    line = f"\nstopped by signal at step {at}; checkpoint saved. Run the same command again to resume.\n"
    assert line in capsys.readouterr().out


def test_a_second_signal_exits_at_once(tmp_path, accelerator):
    def hook(step):
        os.kill(os.getpid(), signal.SIGINT)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(SystemExit) as stop:
        run_fit(tmp_path, accelerator(), make_batches(4), hook=hook)
    assert stop.value.code == 128 + signal.SIGINT and not list_checkpoints(tmp_path)


def test_outside_the_main_thread_the_loop_runs_without_signal_handlers(tmp_path, accelerator):
    acc, done = accelerator(), []
    thread = threading.Thread(target=lambda: done.append(run_fit(tmp_path, acc, make_batches(2))[3].step))
    thread.start()
    thread.join()
    assert done == [4]


def test_a_checkpoint_that_cannot_be_written_is_one_line_keeping_the_others(tmp_path, accelerator, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loop_module, "save_checkpoint", full)
    with pytest.raises(TrainingError) as error:
        run_fit(tmp_path, accelerator(), make_batches(4))
    assert str(error.value) == (
        f"could not save a checkpoint in {tmp_path / 'checkpoints'} (No space left on device); the earlier checkpoints "
        "there are complete: free some space, then run the same command to resume"
    )


def test_a_compiled_model_reports_its_first_step(tmp_path, accelerator, capsys):
    def hook(step):
        pass

    acc = accelerator()
    model, opt = acc.prepare(*model_and_optimizer())
    model.__dict__["_orig_mod"] = model  # what torch.compile's wrapper has
    task = ToyTask(model)
    task.optimizer = opt
    cfg = LoopConfig(epochs=1, log_every=2, progress=False)
    fit(
        task,
        accelerator=acc,
        loader=ToyLoader(make_batches(2)),
        optimizer=opt,
        schedule=SCHEDULE,
        loop=cfg,
        output_dir=tmp_path,
        config_yaml="",
        state=LoopState(),
    )
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "torch.compile" in line]
    assert line.startswith("first step (torch.compile compiling) took ") and line.endswith(" s")
    assert 0 <= float(line.split("compiling) took ")[1].split(" s")[0]) < 60
    run_fit(tmp_path / "eager", accelerator(), make_batches(2))
    assert "torch.compile" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("progress", "main", "shown"), [(True, True, True), (False, True, False), (True, False, False)]
)
def test_the_progress_bar_is_the_main_process_s_and_follows_the_terminal(tmp_path, accelerator, monkeypatch, progress,
                                                                          main, shown):  # fmt: skip
    bars, made, postfixes = [], [], []

    class Bar(loop_module.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append(kwargs)
            made.append(self)
            super().__init__(*args, **kwargs)

        def set_postfix(self, **kwargs):
            postfixes.append(kwargs)
            super().set_postfix(**kwargs)

    class Process(TwoProcesses):
        num_processes = 1
        is_main_process = main

    monkeypatch.setattr(loop_module, "tqdm", Bar)
    run_fit(tmp_path, accelerator(), make_batches(2), progress=progress, wrap=Process)
    assert bars == [{"total": 6, "initial": 0, "disable": not shown, "dynamic_ncols": True, "desc": "train"}]
    assert made[0].n == (4 if shown else 0)  # one update a step
    assert [set(p) for p in postfixes] == [{"loss", "lr", "img_s"}] * 2  # at each log line
    for post, record in zip(postfixes, [r for r in read_metrics(tmp_path) if "lr" in r] if main else [], strict=False):
        assert (post["loss"], post["lr"]) == (f"{record['loss']:.4f}", f"{record['lr']:.2e}")
        assert re.fullmatch(r"\d+\.\d", post["img_s"]), post
