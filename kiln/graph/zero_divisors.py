"""Integer division by a tensor: run on the host, where a zero divisor raises as in eager.

Eager PyTorch raises ``ZeroDivisionError`` for an integer division or remainder by zero.
Compiled engines do not: ONNX Runtime's integer ``Div`` answered -9223372036854775807 for
7 // 0 (a silently wrong answer), and an AOTInductor kernel divides in C++, which traps
(SIGFPE: "Floating point exception", the process ends; one bad request took a server
down). A divisor that is a number is known not to be zero when the graph is captured
(eager would have raised); one that is a tensor is not, so such an operation is placed on
the host, with eager's kernel, by every engine but eager's own
(:func:`kiln.graph.partition.takes`). Float division is left alone: it gives infinities
and NaN as eager does.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

# operator -> the argument that divides
_DIVISOR = {aten.div.Tensor_mode: 1, aten.floor_divide.default: 1, aten.remainder.Tensor: 1,
            aten.fmod.Tensor: 1, aten.remainder.Scalar_Tensor: 1}

WHY_HOST = ("integer division by a tensor: a compiled engine does not raise for a zero divisor "
            "as eager does (ONNX Runtime answers garbage, AOTInductor's kernel ends the process), "
            "so it runs on the host with eager's kernel")


def by_a_tensor(node) -> bool:
    """Whether ``node`` divides integers by a tensor (module doc)."""
    i = _DIVISOR.get(node.target) if node.op == "call_function" else None
    if i is None or len(node.args) <= i or not isinstance(node.args[i], torch.fx.Node):
        return False
    if node.target is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") is None:
        return False                                    # true division: a float result
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and not val.dtype.is_complex \
        and val.dtype != torch.bool
