"""The fused LSTM cell PyTorch picks for a PrivateUse1 device, written with ordinary
operations.

Why: ATen's ``LSTM`` uses the fused cell (``_thnn_fused_lstm_cell``) for every non-CPU
device it counts as an accelerator, PrivateUse1 included; its kernels exist for CUDA only.
kiln runs an operation on the host's CPU kernels, and the CPU has none for it, so
``torch.nn.LSTM`` on the device raised NotImplementedError. :data:`TABLE` gives the
device's dispatcher these functions instead: the forward cell and its backward kernel
(autograd's formula for the fused cell calls it), each the CUDA kernel's arithmetic in
its layout (the workspace holds the activated gates ``[i, f, g, o]``), so the operations
they are made of are recorded, compiled and checked like any other. The tests compare
``nn.LSTM`` training with the CPU's. ``nn.GRU`` still fails, earlier: ATen's GRU transposes a
tensor in place (``transpose_``), which kiln's device tensors do not support.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    return gates


def lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """``(hy, cy, workspace)``; the workspace is the activated gates ``[i, f, g, o]``."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """``(grad_gates, grad_cx, grad_bias)`` from :func:`lstm_cell`'s outputs."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_hy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = torch.cat([grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                            grad_hy * tanh_cy * o * (1 - o)], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


# operator -> the function standing in for it on the device (one dict lookup per call in
# the dispatcher's hot path)
TABLE = {aten._thnn_fused_lstm_cell.default: lstm_cell,
         aten._thnn_fused_lstm_cell_backward_impl.default: lstm_cell_backward}
