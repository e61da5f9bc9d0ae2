"""``nn.TransformerEncoder``'s nested-tensor fast path, for the device's tensors.

In eval mode without gradients, given a padding mask and ``batch_first``,
``nn.TransformerEncoder`` turns its input into a NestedTensor of the real tokens
(``torch._nested_tensor_from_mask``) on any device PyTorch lists as supported, and
PrivateUse1 is listed; its layers then run on the real tokens only, and
``to_padded_tensor(0.0)`` puts zeros where the padding was, before the final norm.
NestedTensors have no form on kiln's device: every such call failed ("NestedTensorImpl
doesn't support sizes"), and ``enable_nested_tensor`` is the module's default, so an
inference script with a padded batch through a stock Transformer encoder could not run.

For the device's tensors the encoder now gives that answer another way: where PyTorch
reaches for the NestedTensor (caught at that call, before any layer has run), the same
layers run over the padded batch with the padding mask (``enable_nested_tensor=False``'s
path, each layer still on its fused fast path), the padded positions are zeroed, then the
final norm, so the output equals the nested path's at every position. Other devices'
calls are PyTorch's own; ``torch._nested_tensor_from_mask`` given a device tensor anywhere
else is a clear error. The second call sets the module's ``norm`` and
``use_nested_tensor`` aside for its duration, so one encoder should not run on the device
from two threads at once.
"""
from __future__ import annotations

import functools

import torch

from kiln.device import tensor as dt


class _Nested(RuntimeError):
    """``torch._nested_tensor_from_mask`` was given a device tensor; ``keep`` is its mask
    (True at the real tokens)."""

    def __init__(self, keep):
        super().__init__("NestedTensors have no form on kiln's device: torch._nested_tensor_from_mask was given "
                         "one of its tensors; run the padded tensor with its padding mask instead")
        self.keep = keep


def install() -> None:
    """Wrap ``torch._nested_tensor_from_mask`` and ``nn.TransformerEncoder.forward`` (once)."""
    encoder = torch.nn.TransformerEncoder
    original = encoder.forward
    if getattr(original, "_kiln", False):
        return
    from_mask = torch._nested_tensor_from_mask

    @functools.wraps(from_mask)
    def nested_from_mask(t, mask, mask_check=True):
        if isinstance(t, dt.DeviceTensor):
            raise _Nested(mask)
        return from_mask(t, mask, mask_check)

    @functools.wraps(original)
    def forward(self, src, *args, **kwargs):
        if not isinstance(src, dt.DeviceTensor):
            return original(self, src, *args, **kwargs)
        try:
            return original(self, src, *args, **kwargs)
        except _Nested as nested:
            keep = nested.keep
        norm, self.norm, self.use_nested_tensor = self.norm, None, False
        try:
            out = original(self, src, *args, **kwargs)
        finally:
            self.norm, self.use_nested_tensor = norm, True
        out = out.masked_fill(keep.logical_not().unsqueeze(-1), 0.0)
        return norm(out) if norm is not None else out

    torch._nested_tensor_from_mask = nested_from_mask
    forward._kiln = True
    encoder.forward = forward
