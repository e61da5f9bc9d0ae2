"""torch_xla's ``runtime`` (``import torch_xla.runtime as xr``) on kiln."""
from __future__ import annotations

from kiln.compat import xla_model as xm


def world_size() -> int:
    return xm.xrt_world_size()


def global_ordinal() -> int:
    return xm.get_ordinal()


def local_ordinal() -> int:
    return xm.get_local_ordinal()


def using_pjrt() -> bool:
    """torch_xla's PJRT runtime is the only one torch_xla 2.x has; scripts branch on it."""
    return True


def addressable_device_count() -> int:
    """Devices this process drives: one (one NeuronCore per process under torch-neuronx)."""
    return 1


local_device_count = addressable_device_count


def local_process_count() -> int:
    """Ranks on this host: torchrun's (and ``xmp.spawn``'s) ``LOCAL_WORLD_SIZE``, else 1."""
    import os
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def global_device_count() -> int:
    return xm.xrt_world_size()


def get_master_ip() -> str:
    import os
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def is_spmd() -> bool:
    return False


def global_runtime_device_count() -> int:
    return xm.xrt_world_size()


def device_type() -> str:
    return "NEURON"


def use_spmd(*args, **kwargs):
    raise NotImplementedError("kiln's device has no SPMD partitioner; use torch.distributed "
                              "(DDP, FSDP2) over the 'xla' backend")


def initialize_cache(path: str, readonly: bool = False):
    """torch_xla's persistent cache: the device's graphs use kiln's compile cache at
    ``path`` (a directory or fsspec URL)."""
    from kiln.device import modes
    xm.xla_device()
    options = dict(modes.policy().options, cache=path)
    modes.set_mode("lazy", **options)
