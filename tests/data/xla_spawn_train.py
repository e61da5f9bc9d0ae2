"""torch_xla's multi-process example scripts in small (test_train_mp_mnist.py's shape,
synthetic data): ``xmp.spawn`` starts the ranks, the script makes no process group of its
own, the replicas start apart and ``xm.broadcast_master_param`` makes them rank 0's, then
``xm.optimizer_step`` averages gradients, ``xm.mesh_reduce``/``xm.all_gather`` collect
metrics. Run unchanged through ``kiln run-xla`` by tests/test_device_distributed.py; rank 0
prints the mean loss per step and writes the final parameters. Then torch_xla's other
collectives (:func:`_collectives`): every rank's results, printed by rank 0 as JSON."""
import importlib
import json
import sys

import numpy as np
import torch
import torch.nn as nn
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
import torch_xla.utils.utils as xu


def _collectives(device, rank, world):
    """xm's collectives on small tensors, what each gave on this rank (the test computes
    what torch_xla gives on the CPU)."""
    got = {}
    # a single tensor: a new tensor, the input unchanged, autograd untouched (the mean loss
    # logged before backward(): the input used to become the mean, its gradients scaled)
    w = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = (w * (rank + 1)).sum()
    mean = xm.all_reduce(xm.REDUCE_SUM, y, scale=1.0 / world)
    y.backward()
    xm.mark_step()
    got["single"] = [float(y), float(mean), mean is y, mean.requires_grad, w.grad.cpu().tolist()]
    # a list: reduced in place, the same list returned
    a, b = torch.tensor([1.0, -2.0 * rank], device=device), torch.tensor([3.0 + rank], device=device)
    both = [a, b]
    back = xm.all_reduce(xm.REDUCE_MAX, both, scale=2.0)
    got["list"] = [back is both, a.cpu().tolist(), b.cpu().tolist()]
    x = (torch.arange(8.0).reshape(2, 4) + 10 * rank).to(device)
    got["reduce_scatter"] = xm.reduce_scatter(xm.REDUCE_SUM, x, 0.5, 1, world).cpu().tolist()
    into = torch.zeros(1, 4, device=device)
    parts = xm.reduce_scatter(xm.REDUCE_MAX, [x, x * -1.0], 1.0, 0, world, output=[into, torch.zeros(1, 4, device=device)])
    got["reduce_scatter_list"] = [parts[0] is into] + [p.cpu().tolist() for p in parts]
    v = (torch.arange(8.0).reshape(4, 2) + 100 * rank).to(device)
    got["all_to_all"] = xm.all_to_all(v, 0, 1, world).cpu().tolist()
    try:
        importlib.import_module("torch_xla.distributed.fsdp")
        got["fsdp"] = "imported"
    except ImportError as e:
        got["fsdp"] = str(e)
    return got


def _mp_fn(index, out):
    device = xm.xla_device()
    rank, world = xm.get_ordinal(), xm.xrt_world_size()
    assert (index, xr.global_ordinal()) == (rank, rank), (index, rank)
    torch.manual_seed(rank)                      # rank 0's replica is the single-process model
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    if xr.using_pjrt():
        xm.broadcast_master_param(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    half = slice(rank * 4 // world, (rank + 1) * 4 // world)
    tracker = xm.RateTracker()
    losses = []
    for data, target in pl.MpDeviceLoader(xu.SampleGenerator((x[half], y[half]), 3), device):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data), target)
        loss.backward()
        xm.optimizer_step(opt)
        tracker.add(data.shape[0])
        losses.append(loss.detach())
    losses = xm.mesh_reduce("losses", [float(v) for v in losses], lambda per_rank: np.mean(per_rank, axis=0))
    gathered = xm.all_gather(torch.tensor([[float(rank), 10.0 + rank]], device=device))
    mean = xm.mesh_reduce("rank_mean", torch.tensor(float(rank), device=device), lambda v: float(sum(v)) / len(v))
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    checks = xm.mesh_reduce("checks", _collectives(device, rank, world), lambda per_rank: per_rank)
    assert tracker.global_rate() > 0
    if xm.is_master_ordinal():
        from kiln.device import metrics
        print("losses", " ".join(f"{v:.7f}" for v in losses))
        print("collectives", gathered.cpu().tolist(), mean, xm.xrt_world_size())
        print("xm_checks", json.dumps(checks))
        print("compiles", metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile"),
              metrics.counter_value("BackgroundCompile"), metrics.counter_value("InterpretedGraphs"))
        torch.save(params, out)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(sys.argv[1],), nprocs=2)
