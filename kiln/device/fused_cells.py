"""The fused LSTM and GRU cells PyTorch picks for a PrivateUse1 device, written with
ordinary operations.

Why: ATen's ``LSTM`` uses the fused cell (``_thnn_fused_lstm_cell``) for every non-CPU
device it counts as an accelerator, PrivateUse1 included (``_thnn_fused_gru_cell`` for
``GRU`` likewise); their kernels exist for CUDA only.
kiln runs an operation on the host's CPU kernels, and the CPU has none for it, so
``torch.nn.LSTM`` on the device raised NotImplementedError. :data:`TABLE` gives the
device's dispatcher these functions instead: the forward cell and its backward kernel
(autograd's formula for the fused cell calls it), each the CUDA kernel's arithmetic in
its layout (the LSTM's workspace holds the activated gates ``[i, f, g, o]``, the GRU's
``[r, z, n, hx, hidden n + its bias]``), so the operations they are made of are recorded,
compiled and checked like any other. The tests compare ``nn.LSTM`` and ``nn.GRU`` training
with the CPU's.
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


def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """``(hy, workspace)``; the workspace is ``[r, z, n, hx, hn + b_hn]``, as CUDA's kernel keeps."""
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return n + z * (hx - n), torch.cat([r, z, n, hx, hn], 1)


def gru_cell_backward(grad_hy, workspace, has_bias):
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)``."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * (1 - r) * r
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_n * r], 1)
    if not has_bias:
        return grad_input, grad_hidden, grad_hy * z, None, None
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


# operator -> the function standing in for it on the device (one dict lookup per call in
# the dispatcher's hot path)
TABLE = {aten._thnn_fused_lstm_cell.default: lstm_cell,
         aten._thnn_fused_lstm_cell_backward_impl.default: lstm_cell_backward,
         aten._thnn_fused_gru_cell.default: gru_cell,
         aten._thnn_fused_gru_cell_backward.default: gru_cell_backward}
