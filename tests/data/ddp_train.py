"""Data-parallel training on kiln's device over 2 processes (torchrun), for
tests/test_device_distributed.py: DDP or FSDP2 (fully_shard), on the 'xla'
torch.distributed backend (xm.optimizer_step's all-reduce: tests/data/xla_spawn_train.py). Each step clips the
gradients' norm (``clip_grad_norm_``: on FSDP2's sharded gradients, DTensor's functional all-reduce). Rank 0 prints the
mean loss and the norm per step and writes the final parameters; then the functional collectives used on their own and
FSDP1 (refused on the device), every rank's results as JSON."""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import kiln.xla.core.xla_model as xm
import kiln.xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

kind, out = sys.argv[1], sys.argv[2]
dist.init_process_group("xla")
rank, world = dist.get_rank(), dist.get_world_size()
device = xm.xla_device()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
if kind == "ddp":
    from torch.nn.parallel import DistributedDataParallel
    run = DistributedDataParallel(model)
elif kind == "fsdp2":
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
    run = model
else:
    raise SystemExit(f"unknown kind {kind!r}: ddp or fsdp2")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
half = slice(rank * 4 // world, (rank + 1) * 4 // world)
losses, norms = [], []
for step in range(3):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(run(x[half].to(device)), y[half].to(device))
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    xm.mark_step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(float(total) / world)
    norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))


def functional_collectives():
    """torch.distributed._functional_collectives on device tensors, each result used after
    (it used to fail at that use: 'invalid python storage')."""
    import torch.distributed._functional_collectives as fc
    t = (torch.tensor([1.0, 2.0]) * (rank + 1)).to(device)
    got = {"all_reduce": (fc.all_reduce(t, "sum", dist.group.WORLD) ** 0.5).cpu().tolist(),
           "all_gather": (fc.all_gather_tensor(t, 0, dist.group.WORLD) * 2).cpu().tolist(),
           "reduce_scatter": (fc.reduce_scatter_tensor(torch.arange(4.0).to(device) + rank, "sum", 0,
                                                       dist.group.WORLD) + 1).cpu().tolist()}
    raw = torch.ops._c10d_functional.all_reduce(t, "max", dist.group.WORLD.group_name)
    got["raw"] = (torch.ops._c10d_functional.wait_tensor(raw) - 1).cpu().tolist()
    xm.mark_step()
    return got


def fsdp1():
    from torch.distributed.fsdp import FullyShardedDataParallel
    try:
        FullyShardedDataParallel(nn.Linear(2, 2).to(device))
        return "constructed"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


checks = [None] * world
dist.all_gather_object(checks, {"funcol": functional_collectives(), "fsdp1": fsdp1()})
params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}
if rank == 0:
    from kiln.device import metrics
    print("losses", " ".join(f"{v:.7f}" for v in losses))
    print("norms", " ".join(f"{v:.7f}" for v in norms))
    print("checks", json.dumps(checks))
    # in a process group, programs compile in-line: every rank swaps them in at one step
    print("compiles", metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile"),
          metrics.counter_value("BackgroundCompile"), metrics.counter_value("InterpretedGraphs"))
    torch.save(params, out)
dist.destroy_process_group()
