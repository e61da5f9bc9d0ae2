"""A CPU tensor that requires grad meeting device tensors in one operation: PyTorch's error.

Why: kiln's device reads host memory, so such an operation computes (a module left on the
CPU, given inputs on the device, returns device tensors), but its backward pass cannot
run: autograd's engine asserts when a gradient on the accelerator reaches a node whose
tensors are on the CPU (``opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED``),
an error that names neither the cause nor the fix. A user meets it by forgetting
``model.to(device)``, or through a library that moved the model back to the CPU
(accelerate, under Hugging Face's Trainer, moves it to its own device). On CUDA the forward
already fails, "Expected all tensors to be on the same device"; kiln now says the same,
with the tensor's shape and what to do, at the operation that mixes them. Copies between
the two (``copy_``, ``.to()``) are differentiable across devices and stay allowed, as do
CPU tensors that need no gradient (constants, indices) and anything under ``no_grad``.
"""
from __future__ import annotations

import torch

from kiln.device import tensor as dt
from kiln.device import walk


def check(func, name: str, args, kwargs) -> None:
    """Raise PyTorch's error when ``func``, about to run on the device, mixes in a CPU
    tensor that requires grad (module doc)."""
    if name == "copy_" or not torch.is_grad_enabled():
        return
    for a in walk.leaves((args, kwargs)):
        if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, dt.DeviceTensor):
            dev = dt.device_type()
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {dev}:0 and "
                f"{a.device}! ({func}: a {a.device} tensor of shape {list(a.shape)} that requires grad, such as "
                f"a parameter of a module left on the CPU, met tensors on {dev}; its backward pass cannot run "
                f"across the two. Move it to the device first: module.to('{dev}'))")
