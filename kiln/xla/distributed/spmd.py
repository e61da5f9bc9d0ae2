"""``torch_xla.distributed.spmd``: importable (libraries import it when they see torch_xla
2.2+: transformers' Trainer does), but kiln's device has no SPMD partitioner, so each call
is an error saying what to use: ``torch.distributed`` (DDP, FSDP2) over the ``"xla"``
backend, or kiln's NxD API for tensor parallelism."""
from __future__ import annotations

_ADVICE = ("kiln's device has no SPMD partitioner; use torch.distributed (DDP, FSDP2) over the 'xla' backend, "
           "or kiln.neuronx_distributed for tensor parallelism")


def _refuse(name):
    def call(*args, **kwargs):
        raise NotImplementedError(f"torch_xla.distributed.spmd.{name}: {_ADVICE}")
    call.__name__ = name
    return call


mark_sharding = _refuse("mark_sharding")
set_global_mesh = _refuse("set_global_mesh")
get_global_mesh = _refuse("get_global_mesh")
clear_sharding = _refuse("clear_sharding")


class Mesh:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"torch_xla.distributed.spmd.Mesh: {_ADVICE}")


HybridMesh = Mesh
