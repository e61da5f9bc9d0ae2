"""A forward that writes to its inputs, parameters or buffers: refused with what to do.

A compiled model is a function of its inputs: its weights and buffers are fixed when it
is compiled, and it writes nothing but its outputs. A forward that updates state in place
(a call counter, an exponential moving average kept in a buffer, ``x.mul_(2)`` on its
input) computes something else at every call, and no compiled graph can follow it: the
comparison with eager then failed with a message about tolerances ("Loosen atol/rtol ...,
or pass validate=False"), whose advice gives a silently wrong model. The capture's own
eager call is watched instead, by each tensor's version counter (which every in-place
write bumps, in any grad mode), and a write is a :class:`~kiln.errors.CaptureError`
naming the tensors.
"""
from __future__ import annotations

import torch

from kiln.errors import CaptureError


def versions(model, named_inputs: dict) -> list:
    """``(label, tensor, version)`` for each input, parameter and buffer of ``model``."""
    watched = [(f"input '{name}'", value) for name, value in named_inputs.items() if isinstance(value, torch.Tensor)]
    if isinstance(model, torch.nn.Module):
        watched += [(f"parameter '{name}'", p) for name, p in model.named_parameters()]
        watched += [(f"buffer '{name}'", b) for name, b in model.named_buffers()]
    out = []
    for label, tensor in watched:
        try:
            out.append((label, tensor, tensor._version))
        except RuntimeError:            # an inference tensor keeps no version: not watched
            pass
    return out


def refuse_writes(model_name: str, before: list) -> None:
    """Raise if any tensor in ``before`` (:func:`versions`) was written since."""
    written = [label for label, tensor, version in before if tensor._version != version]
    if written:
        shown = ", ".join(written[:6]) + (f" and {len(written) - 6} more" if len(written) > 6 else "")
        raise CaptureError(
            f"{model_name} writes to {shown} in its forward (in place: the example call changed "
            "them). A compiled model is a function of its inputs, its weights and buffers fixed "
            "when it is compiled, so these writes would not happen at each call and its answers "
            "would drift from eager's. Compile a forward that leaves its inputs, parameters and "
            "buffers unchanged: return an updated value instead of writing it in place, or keep "
            "such state outside the model")
