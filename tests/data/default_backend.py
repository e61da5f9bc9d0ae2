"""A torchrun script that lets PyTorch choose the backend (``dist.init_process_group()``),
for tests/test_device_distributed.py: a CPU all-reduce and DDP step as any CPU-only script
has them, then the same on kiln's device (``--device``). Each rank writes JSON to ``OUT/rank<N>.json``
(``python default_backend.py OUT [--device]``)."""
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group()
rank = dist.get_rank()
where = "cpu"
if "--device" in sys.argv:
    from kiln.device import modes
    where = modes.device()
t = (torch.arange(3.0) * (rank + 1)).to(where)
dist.all_reduce(t)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2).to(where))
model(torch.ones(1, 3).to(where) * (rank + 1)).sum().backward()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"rank": rank, "backend": str(dist.get_backend()), "sum": t.cpu().tolist(),
               "grad": model.module.weight.grad.cpu().tolist()}, f)
dist.destroy_process_group()
