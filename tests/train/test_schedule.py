import dataclasses
import math

import pytest
import torch

from mae.train.optim import Schedule, apply_lr, lr_at


def test_warmup_then_cosine():
    kw = dict(base_lr=1.0, total_steps=110, warmup_steps=10, min_lr=0.1)
    assert lr_at(0, **kw) == 0.0
    assert math.isclose(lr_at(5, **kw), 0.5)
    assert math.isclose(lr_at(10, **kw), 1.0)
    assert math.isclose(lr_at(60, **kw), 0.55)  # halfway down the cosine
    assert math.isclose(lr_at(110, **kw), 0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lr_at(111, **kw) == lr_at(250, **kw) == 0.1  # steps past the end stay at the floor
    assert lr_at(110, base_lr=1.0, total_steps=110, warmup_steps=10) == 0.0  # the floor defaults to 0


def test_the_warm_up_ends_on_the_base_lr_exactly():
    """Step `warmup_steps` is the cosine's first, base_lr itself: base_lr x 3 / 3 is 0.10000000000000002."""
    assert lr_at(3, base_lr=0.1, total_steps=10, warmup_steps=3) == 0.1
    assert lr_at(2, base_lr=0.1, total_steps=10, warmup_steps=3) == pytest.approx(0.1 * 2 / 3, rel=1e-15)


def test_a_one_step_cosine_reaches_the_floor_on_its_step():
    """A warm-up of all but the last step leaves a cosine of one step, which ends at min_lr."""
    kw = dict(base_lr=1.0, total_steps=11, warmup_steps=10, min_lr=0.1)
    assert lr_at(10, **kw) == 1.0 and lr_at(11, **kw) == pytest.approx(0.1, abs=1e-15)
    assert lr_at(10, base_lr=1.0, total_steps=10, warmup_steps=10) == 1.0  # no steps left: still no division by 0


def test_a_schedule_is_the_formula_with_its_fields_and_peaks_where_the_run_stops_rising():
    schedule = Schedule(base_lr=0.5, min_lr=0.01, warmup_steps=4, total_steps=20)
    kw = dict(base_lr=0.5, total_steps=20, warmup_steps=4, min_lr=0.01)
    assert [schedule.lr(s) for s in range(21)] == [lr_at(s, **kw) for s in range(21)]
    assert schedule.peak == 0.5
    # a warm-up longer than the run: the last step's lr, step 5 of 10 warming up
    assert Schedule(base_lr=1.0, min_lr=0.0, warmup_steps=10, total_steps=6).peak == pytest.approx(0.5)
    assert Schedule(base_lr=1.0, min_lr=0.0, warmup_steps=4, total_steps=1).peak == 0.0  # one step, at lr 0
    assert Schedule(base_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=0).peak == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.base_lr = 1.0  # a run's schedule is fixed once made


def test_apply_lr_keeps_each_groups_scale():
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr_scale": 0.25}, {"params": [q]}], lr=1.0)
    apply_lr(opt, 0.4)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.4]


def test_the_loader_doctor_warns_once_when_the_step_waits_for_data(capsys):
    from types import SimpleNamespace

    from mae.train.loop_state import LoaderDoctor

    doctor = LoaderDoctor(SimpleNamespace(num_processes=1, is_main_process=True), SimpleNamespace(num_workers=0))
    doctor.check(0.9)  # the first window holds the workers' start: not judged
    doctor.check(0.5)  # nor the first minute
    doctor.start -= doctor.SETTLE
    doctor.check(0.5)  # nor a short first epoch, which fills the caches
    assert "data_wait" not in capsys.readouterr().err
    doctor.epoch_end()
    doctor.check(0.1)
    assert "data_wait" not in capsys.readouterr().err
    doctor.check(0.35)
    doctor.check(0.5)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data_wait 35%" in err[0] and "--data.num_workers" in err[0] and "--max_size" in err[0]

    long_first_epoch = LoaderDoctor(
        SimpleNamespace(num_processes=1, is_main_process=True), SimpleNamespace(num_workers=0)
    )
    long_first_epoch.check(0.9)
    long_first_epoch.start -= long_first_epoch.FIRST_EPOCH  # a first epoch this long is judged before its end
    long_first_epoch.check(0.5)
    assert "data_wait 50%" in capsys.readouterr().err
