"""Decompositions kiln adds to the ONNX exporter's, for operators torch leaves whole.

The exporter decomposes an operator its registry lacks with torch's own decompositions
(:func:`kiln.engines.ort_export.translates_by_decomposition`). Torch has none for
``aten.convolution_backward``, the gradient of every convolution in a CNN's training step,
so such a step could not stay on ONNX Runtime: it went whole to Inductor, whose C++ build
took 36 s of the tests' CNN's first step. A convolution's gradients are themselves
convolutions, which ONNX has:

- the input's: the transposed convolution of the output's gradient with the same weight,
  its ``output_padding`` the rows the forward stride dropped;
- the weight's: the convolution of the input with the output's gradient as the kernel,
  batch and channels swapped (stride and dilation trade places), cut to the kernel's size;
- the bias's: the output's gradient summed over all but its channels.

Transposed convolutions' gradients (rare in training steps) are left whole: the
decomposition declines and the operator stays unsupported, as before.

And one the registry translates, but to what ONNX Runtime computes otherwise: batch norm in
training mode becomes ``BatchNormalization(training_mode=1)``, which ONNX Runtime's CPU
build runs with the running statistics, as in evaluation (measured on 11-28: a batch of
mean 1 and deviation 3 came out 20 off eager, within 2e-6 of evaluation-mode batch norm;
its new running statistics 0.1-0.8 off). The check against eager refused every such
build, so every CNN training step with batch norm left ONNX Runtime for Inductor's C++
build. Training-mode batch norm is decomposed instead (torch's own decomposition: a mean,
a variance, the normalization), see :func:`decompose_first`.

And the accumulating index writes (an accumulating ``index_put``, which the embedding
gradient becomes, and ``index_add``): the exporter writes them as ``ScatterND(reduction="add")``,
which ONNX Runtime sums with a race between threads where indices repeat
(:data:`kiln.engines.onnxruntime.WHY_RACES`). Where the product is small
(:func:`sums_by_product`: a tiny model's embedding gradient), kiln writes the sum as a
product instead, ``one_hot(index)ᵀ @ values``, which has no race; the rest run on the host.

And integer floor or trunc division (``a // 1000``, ``torch.div(a, 7, rounding_mode="trunc")``,
``aten.div.Tensor_mode`` once captured): torch's exporter translates it as
``Cast(float32) → Div → Floor/Trunc → Cast``, so a quotient past 2^24 came out rounded
(16,777,217,000 // 1000 gave 16777218; an int32 2,147,483,643 // 3 gave 715827904), and the
check against eager, on small example values, passed. :func:`integer_division` writes it in
integer ops the exporter translates exactly: ``floor_divide`` (ONNX's integer ``Div``, which
truncates, with the floor's correction where the signs differ and a remainder is left),
and trunc as ``floor_divide(a - fmod(a, b), b)`` (an exact multiple of ``b``, no larger than
``a``). Integer ``remainder`` and ``fmod`` already translate to integer ``Mod``.

Whatever goes to ONNX Runtime is checked against eager PyTorch like every compiled
partition.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    sizes = [*input.shape, *weight.shape, *grad_output.shape, *stride, *padding, *dilation, groups]
    if transposed or not all(isinstance(s, int) for s in sizes):
        return NotImplemented
    spatial = range(2, input.dim())
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        dropped = [input.shape[d] - ((grad_output.shape[d] - 1) * stride[d - 2] - 2 * padding[d - 2]
                                     + dilation[d - 2] * (weight.shape[d] - 1) + 1) for d in spatial]
        grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True,
                                              dropped, groups)
    if output_mask[1]:
        grad_weight = _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = aten.sum.dim_IntList(grad_output, [0, *spatial])
    return grad_input, grad_weight, grad_bias


def _weight_gradient(grad_output, input, weight, stride, padding, dilation, groups):
    """``dW[o, i, k] = sum_n,h dY[n, o, h] * X[n, i, h*stride + k*dilation - padding]``: a
    convolution over the input whose batch is the input's channels (per group), whose
    channels are the batch, with the output's gradient as the kernel."""
    n, c_in = input.shape[:2]
    rest, out_rest = list(input.shape[2:]), list(grad_output.shape[2:])
    # X [N, C_in, *] -> [C_in/g, g*N, *]; dY [N, C_out, *] -> [C_out, N, *] (grouped by g)
    x = aten.view.default(input, [n, groups, c_in // groups, *rest])
    x = aten.permute.default(x, [2, 1, 0, *range(3, 3 + len(rest))])
    x = aten.reshape.default(x, [c_in // groups, groups * n, *rest])
    dy = aten.permute.default(grad_output, [1, 0, *range(2, 2 + len(out_rest))])
    full = aten.convolution.default(x, dy, None, dilation, padding, stride, False, [0] * len(rest), groups)
    for d, k in enumerate(weight.shape[2:]):
        if full.shape[2 + d] != k:
            full = aten.slice.Tensor(full, 2 + d, 0, k)
    return aten.permute.default(full, [1, 0, *range(2, 2 + len(rest))])


PRODUCT_LIMIT = 1 << 24     # multiply-adds of a one-hot sum (16M: under a millisecond or so)


def index_put(self, indices, values, accumulate=False):
    """An accumulating ``index_put`` on the first dimension as ``self + one_hot(i)ᵀ @ values``
    (module docstring); anything else declines (``NotImplemented``: the operator stays)."""
    if not accumulate or not _one_index(self, indices, values):
        return NotImplemented
    rows, idx = self.shape[0], indices[0].reshape(-1)
    # each index through a gather from 0..rows-1: a negative one counts from the end, and one
    # out of range raises (ONNX Runtime's Gather checks its indices) where the CPU's index_put
    # raises; an equality with arange alone gave it a row of zeros, its update silently lost
    idx = aten.index_select.default(aten.arange.default(rows, dtype=idx.dtype), 0, idx)
    hot = aten.eq.Tensor(aten.unsqueeze.default(idx, 1), aten.arange.default(rows, dtype=idx.dtype))
    hot = aten._to_copy.default(hot, dtype=values.dtype)
    summed = aten.mm.default(aten.permute.default(hot, [1, 0]), aten.reshape.default(values, [idx.shape[0], -1]))
    return aten.add.Tensor(self, aten.reshape.default(summed, list(self.shape)))


def index_add(self, dim, index, source, *, alpha=1):
    """``index_add`` on the first dimension as the same product (kiln's capture keeps it whole
    for its index check, :mod:`kiln.graph.computed_indices`: its index reaches here checked or
    proven in range); anything else declines."""
    if not isinstance(dim, int) or dim % max(self.dim(), 1) != 0:
        return NotImplemented
    values = source if alpha == 1 else aten.mul.Tensor(source, alpha)
    return index_put(self, [index], values, True)


def _one_index(self, indices, values) -> bool:
    if len(indices) != 1 or indices[0] is None or indices[0].dtype not in (torch.int64, torch.int32):
        return False
    if not self.dtype.is_floating_point or values.dtype != self.dtype:
        return False
    shape = [*indices[0].shape, *self.shape[1:]]
    return list(values.shape) == shape and all(isinstance(d, int) for d in (*shape, self.shape[0]))


def sums_by_product(node) -> bool:
    """Whether an accumulating write (``index_put`` or the embedding gradient) is small enough
    to be summed as a one-hot product on ONNX Runtime (:data:`PRODUCT_LIMIT`)."""
    vals = torch.fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
    if node.target is aten.embedding_dense_backward.default:
        grad, idx, rows = vals[0], vals[1], vals[2]
        if not isinstance(grad, torch.Tensor) or not isinstance(idx, torch.Tensor) or not isinstance(rows, int):
            return False
        return idx.numel() * rows * grad.shape[-1] <= PRODUCT_LIMIT and grad.dtype.is_floating_point
    if node.target is aten.index_put.default and len(vals) >= 3:
        self, indices, values = vals[0], vals[1], vals[2]
        if not isinstance(self, torch.Tensor) or not isinstance(values, torch.Tensor) \
                or not all(isinstance(i, torch.Tensor) for i in indices):
            return False
        return _one_index(self, indices, values) and values.numel() * self.shape[0] <= PRODUCT_LIMIT
    if node.target is aten.index_add.default and len(vals) >= 4:
        self, dim, index, source = vals[:4]
        if not all(isinstance(t, torch.Tensor) for t in (self, index, source)) or not isinstance(dim, int) \
                or dim % max(self.dim(), 1) != 0:
            return False
        return _one_index(self, [index], source) and source.numel() * self.shape[0] <= PRODUCT_LIMIT
    return False


_DIVISIONS = (aten.div.Tensor_mode, aten.div.Scalar_mode)


def integer_division(self, other, *, rounding_mode=None):
    """An integer division rounded down (floor) or toward zero (trunc) in integer ops
    (module docstring); anything else (a float or true division) declines."""
    dtype = _integer_quotient(self, other, rounding_mode)
    if dtype is None:
        return NotImplemented
    a = self if self.dtype == dtype else aten._to_copy.default(self, dtype=dtype)
    if isinstance(other, torch.Tensor):
        b = other if other.dtype == dtype else aten._to_copy.default(other, dtype=dtype)
    else:
        b = aten.full.default([], other, dtype=dtype, device=self.device)
    if rounding_mode == "trunc":
        a = aten.sub.Tensor(a, aten.fmod.Tensor(a, b))      # b * trunc(a / b): exactly divisible
    return aten.floor_divide.default(a, b)


def _integer_quotient(self, other, rounding_mode):
    """The integer dtype of a rounded division's result, or None (float, bool, no rounding)."""
    if rounding_mode not in ("floor", "trunc") or not isinstance(self, torch.Tensor) or \
            not isinstance(other, (torch.Tensor, int)) or isinstance(other, bool):
        return None
    dtype = torch.result_type(self, other)
    return None if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool else dtype


def divides_integers(node) -> bool:
    """Whether ``node`` is an integer floor or trunc division (:func:`integer_division`)."""
    if getattr(node, "target", None) not in _DIVISIONS or len(node.args) < 2:
        return False
    vals = torch.fx.node.map_arg(node.args[:2], lambda a: a.meta.get("val"))
    return _integer_quotient(vals[0], vals[1], node.kwargs.get("rounding_mode")) is not None


# batch norm's training flag, by position: ONNX Runtime computes these wrongly with it set
_TRAINING_ARG = {aten._native_batch_norm_legit_functional.default: 5, aten._native_batch_norm_legit.default: 5,
                 aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.no_stats: 3}


def decompose_first(node) -> bool:
    """Whether ``node``'s operator must be decomposed before export although torch's
    registry translates it: batch norm in training mode, an accumulating write summed as a
    product, and an integer floor or trunc division (see the module's docstring)."""
    target = getattr(node, "target", None)
    if target in _DIVISIONS:
        return divides_integers(node)
    if target in (aten.index_put.default, aten.index_add.default):
        return sums_by_product(node)
    i = _TRAINING_ARG.get(target)
    return i is not None and len(node.args) > i and node.args[i] is not False


TABLE = {aten.convolution_backward.default: convolution_backward, aten.index_put.default: index_put,
         aten.index_add.default: index_add,
         **{op: integer_division for op in _DIVISIONS},
         **{op: torch._decomp.decomposition_table[op] for op in _TRAINING_ARG}}
