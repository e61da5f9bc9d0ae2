"""FSDP2's default mesh where kiln's device is PyTorch's accelerator.

``fully_shard(module)`` without a mesh builds one over the default process group on
``torch._C._get_accelerator()``, and kiln's device is the accelerator wherever kiln is
installed (device autoload). So a CPU-only FSDP2 script over gloo, which never asked for
the device, had its parameters moved onto it and failed at its first line ("variable and
tensor have incompatible tensor type"). Here the default mesh is kiln's device only when the
default group has a backend for it (``xla``, ``kiln``, or ``cpu:gloo,kiln:kiln`` as
:mod:`kiln.device.default_backend` chooses); otherwise it is the CPU, as on a machine
without an accelerator.

FSDP2's module is patched when it is imported (importing it up front costs most of a
second; :mod:`kiln.device.import_patch`).
"""
from __future__ import annotations

from kiln.device import import_patch

TARGET = "torch.distributed.fsdp._fully_shard._fsdp_init"


def install() -> None:
    import_patch.when_imported(TARGET, _patch)


def _patch(module) -> None:
    original = module._init_default_mesh
    if getattr(original, "_kiln", False):
        return

    def _init_default_mesh(mesh_dim_names=None):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from kiln.device import tensor as dt
        if not dist.is_initialized():
            dist.init_process_group()
        if torch._C._get_accelerator().type == dt.device_type() and not _serves_the_device(dist):
            group = dist.distributed_c10d._get_default_group()
            return init_device_mesh("cpu", mesh_shape=(group.size(),), mesh_dim_names=mesh_dim_names)
        return original(mesh_dim_names)

    _init_default_mesh._kiln = True
    module._init_default_mesh = _init_default_mesh


def _serves_the_device(dist) -> bool:
    """Whether the default group has a backend for kiln's device tensors."""
    names = set()
    for part in str(dist.get_backend()).lower().split(","):
        names.add(part.split(":")[-1].strip())
    return bool(names & {"xla", "kiln"})
