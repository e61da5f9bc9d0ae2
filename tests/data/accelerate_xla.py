"""An accelerate training loop as it runs on a Neuron host (accelerate sees torch_xla and
puts everything on its device), for tests/test_device_xla.py: run through ``kiln run-xla`` it
trains on kiln's device, run with plain ``python`` on the CPU. Prints JSON: the device, the
losses, a gather, and what ``save_state`` wrote."""
import json
import os
import sys

import torch
from accelerate import Accelerator

out = sys.argv[1]
acc = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g))
model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
losses = []
for x, y in loader:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(float(loss))
acc.wait_for_everyone()
acc.save_state(out)
print(json.dumps({"device": str(acc.device), "param_device": str(next(model.parameters()).device),
                  "losses": losses, "gathered": acc.gather(torch.tensor([1.0], device=acc.device)).cpu().tolist(),
                  "saved": sorted(os.listdir(out)),
                  "main": [acc.is_main_process, acc.is_local_main_process, acc.local_process_index]}))
