"""A torchrun script that lets PyTorch choose the backend (``dist.init_process_group()``),
for tests/test_device_distributed.py: a CPU all-reduce and DDP step as any CPU-only script
has them, then the same on kiln's device (imported only then; eager mode). Both include a
functional all-reduce whose result is used after (``torch.distributed._functional_collectives``,
what DTensor and FSDP2 call). Each rank writes JSON to ``OUT/rank<N>.json``
(``python default_backend.py OUT``)."""
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

dist.init_process_group()
rank = dist.get_rank()
out = {"rank": rank, "backend": str(dist.get_backend())}
for where in ("cpu", "device"):
    if where == "device":
        from kiln.device import modes
        where = modes.device()
    t = (torch.arange(3.0) * (rank + 1)).to(where)
    dist.all_reduce(t)
    reduced = fc.all_reduce(t * 2, "sum", dist.group.WORLD) + 1
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2).to(where))
    model(torch.ones(1, 3).to(where) * (rank + 1)).sum().backward()
    out[str(torch.device(where).type)] = {"sum": t.cpu().tolist(), "grad": model.module.weight.grad.cpu().tolist(),
                                          "funcol": reduced.cpu().tolist(),
                                          "on": str(t.device.type)}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
