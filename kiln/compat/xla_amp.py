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


class GradScaler(torch.amp.GradScaler):
    """torch_xla's ``amp.GradScaler``: ``torch.amp.GradScaler`` on kiln's device, with torch_xla's
    signature. A step whose gradients overflowed is skipped and the scale backed off, as
    torch's scaler does; ``use_zero_grad=True`` (torch_xla's variant that steps with zeroed
    gradients instead, which moves momentum and weight decay) is refused rather than
    approximated."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, use_zero_grad: bool = False):
        if use_zero_grad:
            from kiln.errors import InputError
            raise InputError("GradScaler(use_zero_grad=True) is not supported by kiln: its scaler skips a "
                             "step whose gradients overflowed, as torch.amp.GradScaler does; drop the argument")
        super().__init__(kiln_type(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


def _syncfree(base):
    """torch_xla's sync-free optimizer: ``base`` whose ``step`` also takes ``found_inf`` (a
    tensor, nonzero when the scaled gradients overflowed) and then does nothing. On XLA
    that test stays on the device; here reading it runs what the device has queued, which
    a lazy step does at ``mark_step`` anyway."""

    def step(self, closure=None, found_inf=None):
        if found_inf is not None and bool(found_inf.detach().cpu().sum() != 0):
            return None if closure is None else closure()
        return base.step(self, closure)

    return type(base.__name__, (base,), {"step": step, "__doc__": _syncfree.__doc__.replace("``base``", base.__name__),
                                        "__module__": __name__})


SGD = _syncfree(torch.optim.SGD)
Adam = _syncfree(torch.optim.Adam)
AdamW = _syncfree(torch.optim.AdamW)
