"""``torch.Generator(device="kiln")``: a CPU generator.

The device draws its random numbers on the host, from CPU generators (the default one,
``torch.manual_seed``'s, or one passed as ``generator=``), so that a seed gives the CPU's
numbers. PyTorch makes a device's generator through the backend's C++ hooks
(``getNewGenerator``), which a Python backend cannot provide (2.13), and raised "You should
register `PrivateUse1HooksInterface` ... getNewGenerator" for every script that makes its
generator on its accelerator (``torch.Generator(device=device)``). :func:`install` makes
that call return a CPU generator: the device's random operations take it
(``torch.randn(..., generator=g, device="kiln")`` equals ``torch.randn(..., generator=g)``
from the same seed), and its ``device`` reads ``cpu``, where the numbers are drawn.
Generators for any other device are PyTorch's own.
"""
from __future__ import annotations

import torch


def install(name: str) -> None:
    """Route ``torch.Generator(device=<name>)`` to a CPU generator. ``torch.Generator``
    stays PyTorch's class (``isinstance`` and ``type(g) is torch.Generator`` hold as
    before); the hook is its metaclass's call, which only PyTorch's Python metaclass has:
    on a torch whose Generator has none, nothing changes."""
    generator = torch._C.Generator
    meta = type(generator)
    if meta is type or getattr(meta.__call__, "_kiln_generators", False):
        return
    original = meta.__call__

    def __call__(cls, *args, **kwargs):
        if cls is generator and (args or kwargs):
            device = args[0] if args else kwargs.get("device")
            try:
                kind = torch.device(device).type if device is not None else None
            except (RuntimeError, TypeError, ValueError):
                kind = None
            if kind == name:
                return original(cls)
        return original(cls, *args, **kwargs)

    __call__._kiln_generators = True
    meta.__call__ = __call__
