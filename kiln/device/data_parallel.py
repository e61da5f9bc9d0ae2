"""``nn.DataParallel`` where kiln's device is PyTorch's accelerator.

``nn.DataParallel`` spreads a batch over the first accelerator type PyTorch finds, and
kiln's device is one wherever kiln is installed (device autoload). Two things failed:

* A CPU script that wraps its model in ``DataParallel`` (as scripts meant to run with or
  without a GPU do) raised "module must have its parameters and buffers on device kiln:0"
  in any environment with kiln installed, though it never asked for the device. Without an
  accelerator PyTorch calls the module as it is; a module whose parameters are all on the
  CPU is now called so.
* A module on kiln's device raised in the scatter (``torch._C._scatter`` is CUDA's). A
  process has one kiln device (``kiln:1`` is ``kiln:0``: the device count is the cores a
  model may own, as Neuron counts NeuronCores), so this is PyTorch's one-device path: the
  inputs are moved to the device and the module is called on them.
"""
from __future__ import annotations

import functools
import itertools

import torch

from kiln.device import tensor as dt, walk


def install() -> None:
    """Wrap ``nn.DataParallel.forward`` (once)."""
    dp = torch.nn.DataParallel
    forward = dp.forward
    if getattr(forward, "_kiln", False):
        return

    @functools.wraps(forward)
    def on_cpu_or_device(self, *inputs, **kwargs):
        if not (self.device_ids and self.src_device_obj.type == dt.device_type()):
            return forward(self, *inputs, **kwargs)
        held = list(itertools.chain(self.module.parameters(), self.module.buffers()))
        if all(t.device.type == "cpu" for t in held):
            return self.module(*inputs, **kwargs)
        if any(t.device.type != dt.device_type() for t in held):
            return forward(self, *inputs, **kwargs)       # PyTorch's error, naming the device
        move = functools.partial(_to, self.src_device_obj)
        return self.module(*walk.rebuild(tuple(inputs), move, _is_tensor), **walk.rebuild(kwargs, move, _is_tensor))

    on_cpu_or_device._kiln = True
    dp.forward = on_cpu_or_device


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _to(device, t):
    return t.to(device)
