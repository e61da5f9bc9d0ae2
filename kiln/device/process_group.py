"""A ``torch.distributed`` backend for kiln's device: gloo over the device's host memory.

``dist.init_process_group("xla")`` (torch-neuronx's spelling; ``init_method="xla://"`` is
``env://``) or ``("kiln")`` makes a
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

from kiln.device import dispatch
from kiln.distributed.groups import NamedProcessGroup
from kiln.device.tensor import DeviceTensor, device_type

_LOCK = threading.Lock()
_done: list = []


def _host(tensors):
    dispatch.materialize()
    return [t.host() if isinstance(t, DeviceTensor) else t for t in tensors]


def _finished(work, result):
    if work is not None:
        work.wait()
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class KilnProcessGroup(NamedProcessGroup, dist.ProcessGroup):
    """gloo underneath; device tensors handed over as their host memory."""

    def __init__(self, store, rank: int, size: int, timeout=timedelta(minutes=30)):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # the functional collectives (torch.ops.c10d.*, used by FSDP2 and DTensor) reach
        # the group through its per-device backends: the device hands them host tensors
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

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
        for out, inp in zip(_host(outputs), _host(inputs)):       # gloo has no coalesced form
            self._gloo._allgather_base(out, inp, opts).wait()
        return _finished(None, outputs)

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
        for out, inp in zip(_host(outputs), _host(inputs)):
            self._gloo._reduce_scatter_base(out, inp, opts).wait()
        return _finished(None, outputs)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return _finished(self._gloo.allreduce_coalesced(_host(tensors), opts), tensors)

    def barrier(self, opts=None):
        dispatch.materialize()
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


def _fsdp2_storage_on_host():
    """FSDP2 frees an unsharded parameter between uses by resizing its storage to 0 and
    reallocates it the same way. A kiln device tensor's memory is its host tensor, held
    by the tensor itself; it has no storage for FSDP2 to resize. Both become no-ops for
    device tensors (the unsharded copy stays allocated in host memory; FSDP2 still
    writes every all-gather into it), unchanged for every other tensor. torch 2.13's
    layout; without those functions this does nothing."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:
        return
    if getattr(_fsdp_param.free_storage, "_kiln", False):
        return
    free, alloc = _fsdp_param.free_storage, _fsdp_param.alloc_storage

    def free_storage(tensor):
        if not isinstance(tensor, DeviceTensor):
            free(tensor)

    def alloc_storage(tensor):
        if not isinstance(tensor, DeviceTensor):
            alloc(tensor)
    free_storage._kiln = alloc_storage._kiln = True
    _fsdp_param.free_storage = free_storage
    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage


FSDP1_ADVICE = ("FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported on kiln's device: it "
                "flattens parameters into one storage and resizes it, and a kiln device tensor's memory is a host "
                "tensor it holds, not a storage to resize. Use FSDP2's fully_shard (from torch.distributed.fsdp "
                "import fully_shard) on the 'xla' backend, which kiln supports (clip_grad_norm_ included)")


def _fsdp1_refused():
    """FSDP1 on the device is an error at construction, saying to use FSDP2: it failed
    deep in its sharding (``Trying to resize storage that is not resizable``). The check is
    where FSDP1 flattens a module's parameters (``FlatParamHandle``), given the device it
    computes on, wherever the parameters came from (already on the device, or moved there
    by ``device_id``). Unchanged for every other device; torch 2.13's layout."""
    try:
        from torch.distributed.fsdp import _flat_param
    except ImportError:
        return
    handle = _flat_param.FlatParamHandle
    init = handle.__init__
    if getattr(init, "_kiln", False):
        return

    def __init__(self, params, fully_sharded_module, device, *args, **kwargs):
        if torch.device(device).type == device_type():
            raise NotImplementedError(f"kiln: {FSDP1_ADVICE}")
        init(self, params, fully_sharded_module, device, *args, **kwargs)
    __init__._kiln = True
    handle.__init__ = __init__


def register():
    """Register the ``"xla"`` and ``"kiln"`` backends (once per process) for the CPU and
    kiln's device."""
    with _LOCK:
        if _done:
            return
        device = device_type()
        for name in ("xla", "kiln"):
            if name not in dist.Backend.backend_list:
                dist.Backend.register_backend(name, _create, devices=["cpu", device])
        _fsdp2_storage_on_host()
        _fsdp1_refused()
        _xla_rendezvous()
        _done.append(True)


def _xla_rendezvous():
    """``init_method="xla://"`` (torch_xla's rendezvous, in its examples): the launcher's
    environment (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), as ``env://``."""
    import importlib
    rendezvous = importlib.import_module("torch.distributed.rendezvous")   # the package has a function so named
    if "xla" not in rendezvous._rendezvous_handlers:
        rendezvous.register_rendezvous_handler("xla", rendezvous._env_rendezvous_handler)
