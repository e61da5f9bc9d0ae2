"""What a collective run on kiln's device returns (:func:`kiln.device.dispatch.run_now`).

Collectives run now, on the tensors' host data: the in-place ones (``c10d::allreduce_``,
``dist.all_reduce``) and the functional ones (``_c10d_functional::all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``wait_tensor``: what FSDP2 and
DTensor call, ``clip_grad_norm_`` on sharded gradients included). A result that is a
tensor the collective was given is given back as the device tensor it came from
(``wait_tensor(x)`` is ``x``, as on the CPU); any other result is a new device tensor
over its host data.

PyTorch wraps a functional collective's result in an ``AsyncCollectiveTensor`` (through
``_c10d_functional::_wrap_tensor_autograd``) that waits at its first use. Run on host
data, that wrapper came back as a device tensor's "host data": a wrapper subclass with
no memory of its own, and the next operation that read it failed ("Attempted to access
the data pointer on an invalid python storage"). Such a result waits here instead (the
device's collectives finish before they return, as its process group's do) and is given
back as the device tensor it wraps.
"""
from __future__ import annotations

import torch

from kiln.device import tensor as dt
from kiln.device import walk


def _waited(o):
    """``o``, or the tensor it wraps once waited for when it is an AsyncCollectiveTensor."""
    if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor and hasattr(o, "_get_acs_underlying_tensor"):
        return o.trigger_wait()
    return o


def same_tensors(out, inputs):
    """A collective's outputs (the tensors it wrote or made, a Work handle) with the device
    tensors it was given in place of their host data, and new device tensors for the rest."""
    mine = {id(t._kc.data): t for t in walk.leaves(inputs) if isinstance(t, dt.DeviceTensor)}

    def back(o):
        o = _waited(o)
        if id(o) in mine:
            return mine[id(o)]
        return dt.wrap(o) if isinstance(o, torch.Tensor) else o
    return walk.tmap(back, out)
