"""A ``torch.distributed`` backend for kiln's device: gloo over the device's host memory.

``dist.init_process_group("xla")`` (torch-neuronx's spelling) or ``("kiln")`` makes a
process group whose collectives take kiln device tensors: each runs what the device has
queued, then hands gloo the tensors' host memory (no copy), so DDP and
``xm.optimizer_step``'s gradient all-reduce work across ``torchrun`` processes. CPU
tensors in the same group go to gloo as they are (one group for both devices).
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from kiln.device import modes
from kiln.device.tensor import DeviceTensor

_LOCK = threading.Lock()
_done: list = []


def _host(tensors):
    modes.synchronize()
    return [t.host() if isinstance(t, DeviceTensor) else t for t in tensors]


def _finished(work, result):
    work.wait()
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class KilnProcessGroup(dist.ProcessGroup):
    """gloo underneath; device tensors handed over as their host memory."""

    def __init__(self, store, rank: int, size: int, timeout=timedelta(minutes=30)):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self):
        return "kiln"

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return _finished(self._gloo.allreduce(_host(tensors), opts), tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return _finished(self._gloo.broadcast(_host(tensors), opts), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        outs = [_host(group) for group in output_tensors]
        return _finished(self._gloo.allgather(outs, _host(input_tensors), opts), output_tensors)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        out, inp = _host([output, input])
        return _finished(self._gloo._allgather_base(out, inp, opts), output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return _finished(self._gloo.allgather_into_tensor_coalesced(_host(outputs), _host(inputs), opts), outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        ins = [_host(group) for group in input_tensors]
        return _finished(self._gloo.reduce_scatter(_host(output_tensors), ins, opts), output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        out, inp = _host([output, input])
        return _finished(self._gloo._reduce_scatter_base(out, inp, opts), output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return _finished(self._gloo.reduce_scatter_tensor_coalesced(_host(outputs), _host(inputs), opts), outputs)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return _finished(self._gloo.allreduce_coalesced(_host(tensors), opts), tensors)

    def barrier(self, opts=None):
        modes.synchronize()
        return _finished(self._gloo.barrier(opts or dist.BarrierOptions()), None)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        out, inp = _host([output, input])
        return _finished(self._gloo.alltoall_base(out, inp, output_split_sizes, input_split_sizes, opts), output)

    def send(self, tensors, dst, tag=0):
        return _finished(self._gloo.send(_host(tensors), dst, tag), tensors)

    def recv(self, tensors, src, tag=0):
        return _finished(self._gloo.recv(_host(tensors), src, tag), tensors)


def _create(store, rank, size, timeout):
    return KilnProcessGroup(store, rank, size, timeout)


def register():
    """Register the ``"xla"`` and ``"kiln"`` backends (once per process) for the CPU and
    kiln's device."""
    with _LOCK:
        if _done:
            return
        device = modes.device().type
        for name in ("xla", "kiln"):
            if name not in dist.Backend.backend_list:
                dist.Backend.register_backend(name, _create, devices=["cpu", device])
        _done.append(True)
