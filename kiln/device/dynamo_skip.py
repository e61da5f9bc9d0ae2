"""Dynamo never traces the device's own Python.

A model on kiln's device given to ``torch.compile`` (any backend) ran Dynamo into the
device's dispatcher: each operation reached kiln's ``__torch_dispatch__``, whose frames
Dynamo then compiled as if they were the user's code, in fragments. That was slow (a small
MLP's first call took 6 s with Inductor) and, with ``backend="kiln"``, a crash: a
fragment returning a Python int from inside the dispatcher raised StopIteration. From the
first ``torch.compile`` on, the device's modules are on Dynamo's skip list
(``torch._dynamo.trace_rules.add``): Dynamo leaves a model on the device's tensors to run as
the device runs it, and the device's eager or lazy mode compiles its own programs. CPU
tensors are Dynamo's as before. Nothing is imported until then (``torch._dynamo`` takes
about a second to import).
"""
from __future__ import annotations

import functools

import torch

_done: list = []


def skip_device_frames() -> None:
    """Put ``kiln.device``'s modules on Dynamo's skip list (once)."""
    if not _done:
        from torch._dynamo import trace_rules
        trace_rules.add("kiln.device")
        _done.append(True)


def install() -> None:
    """Wrap ``torch.compile`` so that its first call does :func:`skip_device_frames`."""
    original = torch.compile
    if getattr(original, "_kiln", False):
        return

    @functools.wraps(original)
    def compile(*args, **kwargs):
        skip_device_frames()
        return original(*args, **kwargs)

    compile._kiln = True
    torch.compile = compile
