import math

import torch

from mae.train.optim import apply_lr, lr_at


def test_warmup_then_cosine():
    kw = dict(base_lr=1.0, total_steps=110, warmup_steps=10, min_lr=0.1)
    assert lr_at(0, **kw) == 0.0
    assert math.isclose(lr_at(5, **kw), 0.5)
    assert math.isclose(lr_at(10, **kw), 1.0)
    assert math.isclose(lr_at(60, **kw), 0.55)  # halfway down the cosine
    assert math.isclose(lr_at(110, **kw), 0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_apply_lr_keeps_each_groups_scale():
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr_scale": 0.25}, {"params": [q]}], lr=1.0)
    apply_lr(opt, 0.4)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.4]


def test_the_loader_doctor_warns_once_when_the_step_waits_for_data(capsys):
    from types import SimpleNamespace

    from mae.train.metrics import LoaderDoctor

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
