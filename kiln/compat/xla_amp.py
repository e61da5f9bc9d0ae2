"""torch_xla's mixed precision on kiln's device: ``torch.autocast("xla", ...)`` and
``torch_xla.amp.autocast(device)``.

Why: a torch-neuronx script asks for bf16 with ``torch.autocast("xla", dtype=torch.bfloat16)``
(or torch_xla's ``amp.autocast``). Autocast is switched on per device type, and kiln's
tensors are PrivateUse1's, not XLA's: the context was accepted, reached none of the
script's operations, and the script trained in float32 without a word. Once a script imports
``kiln.xla`` (its swapped imports, or ``kiln run-xla``), :func:`install` makes ``torch.autocast``
read ``"xla"`` as kiln's device type; every other device type is torch's own, unchanged.
"""
from __future__ import annotations

import torch

_TORCH = torch.amp.autocast_mode.autocast


def kiln_type() -> str:
    return torch._C._get_privateuse1_backend_name()


class autocast(_TORCH):  # noqa: N801 - torch's name
    """``torch.autocast`` with ``"xla"`` meaning kiln's device (module doc)."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        super().__init__(kiln_type() if device_type == "xla" else device_type, dtype=dtype, enabled=enabled,
                         cache_enabled=cache_enabled)


def xla_autocast(device, enabled: bool = True, dtype: torch.dtype | None = None, cache_enabled: bool | None = None):
    """torch_xla's ``amp.autocast(device, enabled=True, dtype=None)``: bf16 by default, as on
    Neuron and TPUs; ``device`` is the device (``xm.xla_device()``) or its type."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return autocast(kind, dtype=dtype or torch.bfloat16, enabled=enabled, cache_enabled=cache_enabled)


def install():
    """``torch.autocast`` (and ``torch.amp.autocast``) become :class:`autocast`, once."""
    if torch.autocast is _TORCH:
        torch.autocast = autocast
    if torch.amp.autocast is _TORCH:
        torch.amp.autocast = autocast
