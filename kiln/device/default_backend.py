"""``torch.distributed.init_process_group()`` with no backend, where kiln's device is
PyTorch's accelerator.

Given no backend, PyTorch takes the one its table names for the machine's accelerator, and
kiln's device is the accelerator wherever kiln is installed (device autoload). The table
has no entry for it, so every script that lets PyTorch choose, CPU-only ones included (a
``torchrun`` job with gloo in mind), failed at its first line: "We detected accelerator
kiln on your machine. But we don't know which communication backend to use". Such a call
now gets ``"cpu:gloo,kiln:kiln"``: gloo for CPU tensors, as on a machine without an
accelerator, and kiln's process group (:mod:`kiln.device.process_group`, gloo over the
device's host memory) for device tensors. A backend the script names is its own.
"""
from __future__ import annotations

import functools

import torch

from kiln.device import tensor as dt


def install() -> None:
    """Wrap ``init_process_group`` in ``torch.distributed`` and its ``distributed_c10d``
    (once; both are already imported by ``import torch``)."""
    import torch.distributed as dist
    c10d = dist.distributed_c10d
    original = c10d.init_process_group
    if getattr(original, "_kiln", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        backend = args[0] if args else kwargs.get("backend")
        if (backend is None or str(backend).lower() == "undefined") and _accelerator_is_ours():
            from kiln.device import process_group
            process_group.register()
            chosen = f"cpu:gloo,{dt.device_type()}:kiln"
            if args:
                args = (chosen,) + args[1:]
            else:
                kwargs["backend"] = chosen
        return original(*args, **kwargs)

    init_process_group._kiln = True
    c10d.init_process_group = dist.init_process_group = init_process_group


def _accelerator_is_ours() -> bool:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and accelerator.type == dt.device_type()
