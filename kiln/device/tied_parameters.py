"""Tied parameters stay tied when a module moves to or from kiln's device.

``Module.to(device)`` keeps a parameter object (``param.data = moved``) only where the old
and new tensors have the same kind of implementation; a CPU tensor and a device tensor (a
wrapper subclass) do not, so PyTorch makes a new ``Parameter`` per module instead. A
parameter that two modules share (GPT-2's and T5's input embedding and output projection,
Hugging Face's ``tie_word_embeddings``) became two parameters after ``.to("kiln")``: the
optimizer updated them apart, each with half of the gradient it had on the CPU, and
training silently left the CPU's losses from the second step on. (torch_xla's tensors break
ties the same way, and Hugging Face's Trainer re-ties on TPUs; a plain loop does not.)

:func:`install` wraps ``Module._apply``, which every ``to``/``float``/``cpu`` goes through:
at the outermost call it notes which modules share which parameter or buffer, and after
the move gives every module that shared one the same new tensor.
"""
from __future__ import annotations

import functools
import threading

import torch

from kiln.device import tensor as dt

_DEPTH = threading.local()


def install() -> None:
    """Wrap ``torch.nn.Module._apply`` (once)."""
    module = torch.nn.Module
    apply = module._apply
    if getattr(apply, "_kiln", False):
        return

    @functools.wraps(apply)
    def keeping_ties(self, fn, *args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        shared = _shared(self) if depth == 0 else None
        _DEPTH.n = depth + 1
        try:
            out = apply(self, fn, *args, **kwargs)
        finally:
            _DEPTH.n = depth
        if shared:
            _tie(shared)
        return out

    keeping_ties._kiln = True
    module._apply = keeping_ties


def _shared(root) -> list:
    """``[(dict name, [(module, key), ...], on the device)]`` for each tensor held under two
    or more names in ``root``'s modules; empty (the common case) when none is."""
    seen: dict = {}
    for mod in root.modules():
        for kind in ("_parameters", "_buffers"):
            for key, tensor in getattr(mod, kind).items():
                if tensor is not None:
                    seen.setdefault(id(tensor), (kind, [], isinstance(tensor, dt.DeviceTensor)))[1].append((mod, key))
    return [entry for entry in seen.values() if len(entry[1]) > 1]


def _tie(shared) -> None:
    """Give each group's places the first place's tensor where a move to or from kiln's
    device made them new tensors; other moves (which keep the objects) are left alone."""
    for kind, places, was_on_device in shared:
        first = getattr(places[0][0], kind)[places[0][1]]
        moved = [getattr(mod, kind)[key] for mod, key in places]
        if all(t is first for t in moved):
            continue
        if not (was_on_device or any(isinstance(t, dt.DeviceTensor) for t in moved)):
            continue
        for mod, key in places[1:]:
            getattr(mod, kind)[key] = first
