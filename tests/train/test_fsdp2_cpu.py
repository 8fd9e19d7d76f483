"""FSDP2 on two CPU processes over gloo. Accelerate turns FSDP on only for GPU-like devices (a CPU run becomes
MULTI_CPU, i.e. DDP), so this makes the calls Accelerate's FSDP2 path makes, with the plan of
recipes/accelerate/fsdp2_vit_large.yaml: `fully_shard` on every transformer block (`Block`, `CrossBlock`), then on the
root; a sharded checkpoint through torch.distributed.checkpoint (SHARDED_STATE_DICT); the full weights gathered for
the export. Needs torch >= 2.6 (`torch.distributed.fsdp.fully_shard`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp
from safetensors.torch import load_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 needs torch >= 2.6"),
]

STEPS, SAVE_AT, BATCH = 6, 3, 8

WORKER = f"""
import json, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
    set_state_dict)
from torch.distributed.fsdp import fully_shard
from safetensors.torch import save_file
import mae

mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = mae.create_mae("mae_vit_micro_patch8", img_size=32)
if mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
else:  # Accelerate's fsdp2_prepare_model with TRANSFORMER_BASED_WRAP: each block a unit, then the root
    for m in model.modules():
        if type(m).__name__ in ("Block", "CrossBlock"):
            fully_shard(m, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
start = 0
if mode == "fsdp_resume":
    msd, osd = get_state_dict(model, opt)
    state = {{"model": msd, "optim": osd}}
    dcp.load(state, checkpoint_id=out + "/ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    start = {SAVE_AT}
losses = []
for step in range(start, {STEPS}):
    g = torch.Generator().manual_seed(step)
    imgs, noise = torch.randn({BATCH}, 3, 32, 32, generator=g), torch.rand({BATCH}, 16, generator=g)
    half = slice(rank * {BATCH} // world, (rank + 1) * {BATCH} // world)  # this process's share of the batch
    loss = model(imgs[half], noise=noise[half]).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
    if mode == "fsdp" and step + 1 == {SAVE_AT}:
        msd, osd = get_state_dict(model, opt)
        dcp.save({{"model": msd, "optim": osd}}, checkpoint_id=out + "/ckpt")
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    full = {{k.removeprefix("module."): v.contiguous() for k, v in full.items()}}
    save_file(full, out + f"/{{mode}}.safetensors")
    json.dump(losses, open(out + f"/{{mode}}.json", "w"))
dist.barrier()  # as the stages end (close_accelerator): no process leaves while the main one writes
dist.destroy_process_group()
"""


def launch(tmp_path: Path, mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import json

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), mode,
           str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / f"{mode}.json").read_text()), load_file(tmp_path / f"{mode}.safetensors")


def test_fsdp2_trains_as_ddp_resumes_bit_identically_and_exports_ddps_weights(tmp_path):
    ddp_losses, ddp = launch(tmp_path, "ddp")
    fsdp_losses, fsdp = launch(tmp_path, "fsdp")
    resumed_losses, resumed = launch(tmp_path, "fsdp_resume")
    # gloo has no average: FSDP2 sums the gradients (reduce-scatter) and divides by the world size, as DDP does
    # (all-reduce). On two processes each element is the sum of two numbers, the same in either order, so the runs
    # agree bit for bit (measured: max abs diff 0.0); a sum left undivided would double every update at step 1.
    assert len(fsdp_losses) == STEPS and fsdp_losses == ddp_losses
    # the sharded checkpoint (model and optimizer) resumes at the same world size: the same steps, bit for bit
    assert resumed_losses == fsdp_losses[SAVE_AT:]
    assert resumed.keys() == fsdp.keys() and all(torch.equal(resumed[k], fsdp[k]) for k in fsdp)
    # the export gathers the shards into the plain model's keys and values: DDP's weights
    assert fsdp.keys() == ddp.keys()
    assert max((fsdp[k] - ddp[k]).abs().max().item() for k in fsdp) == 0.0
