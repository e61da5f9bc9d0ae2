"""``neuronx_distributed.utils``: NxD's device helpers. ``NXD_CPU_MODE=1`` (NxD's own CPU
path) makes ``get_device()`` the CPU and ``mark_step()`` a no-op; otherwise the device is
kiln's (``xm.xla_device()``) and ``mark_step`` runs what lazy mode has queued."""
from __future__ import annotations

from kiln import config


def cpu_mode() -> bool:
    return config.flag("NXD_CPU_MODE")


def mark_step() -> None:
    if not cpu_mode():
        import kiln.xla.core.xla_model as xm
        xm.mark_step()


def get_device():
    import torch
    if cpu_mode():
        return torch.device("cpu")
    import kiln.xla.core.xla_model as xm
    return xm.xla_device()


def master_print(msg, *args, **kwargs) -> None:
    """Print on global rank 0 only."""
    from kiln.distributed import state
    if state.is_global_rank_zero():
        print(msg, *args, **kwargs)
