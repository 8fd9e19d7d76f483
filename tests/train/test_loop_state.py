"""The loop's step bookkeeping (mae/train/loop_state.py): a step with non-finite gradients changes nothing, with a
fused optimizer (the kernel reads `found_inf`) and with a plain one (not stepped at all)."""

from types import SimpleNamespace

import pytest
import torch

from mae.train.loop_state import LoopState, Skips

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adamw_plain": lambda p: torch.optim.AdamW(p, lr=0.1, fused=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_nonfinite_step_leaves_weights_and_state_then_a_finite_one_steps(name):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = OPTIMIZERS[name]([weight])
    skips = Skips(SimpleNamespace(device=torch.device("cpu")), optimizer)
    assert skips.fused == (name == "adamw_fused")
    state = LoopState()
    for bad in (float("inf"), float("nan")):
        weight.grad = torch.full((3,), bad)
        skips.step(weight.grad.norm())
        assert torch.equal(weight.detach(), torch.ones(3)), name  # neither the update nor a NaN reached the weight
        assert all(not torch.is_tensor(v) or v.isfinite().all() for s in optimizer.state.values() for v in s.values())
    assert skips.collect(state) == 2 and state.nonfinite_steps == 2  # two in a row, both counted
    weight.grad = torch.full((3,), 0.5)
    skips.step(weight.grad.norm())
    assert (weight.detach() < 1).all() and weight.isfinite().all()  # stepped against the gradient
    assert skips.collect(state) == 0 and state.nonfinite_steps == 2  # the run of skips ended; none since
