"""Which ops OpenVINO's CPU plugin would silently compute in other types, so that kiln keeps
them off it: it computes int64 in int32 and float64 in float32. int64 ops stay on OpenVINO
only where their values provably fit int32 (the interval arithmetic of :func:`_range`); the
runtime range-checks int64 inputs on every call (:class:`kiln.engines.openvino.OvRunner`).

bfloat16 and float16 ops are taken where the CPU computes that type natively (elsewhere kiln
emulates its rounding on the host, which the plugin would drop): at the float32 precision kiln pins (unless a native
``--auto-cast`` asks for bf16/f16) the plugin computes them in float32, keeping the graph's
narrow values narrow between operations, so its answers differ from eager's by roundings,
as Inductor's fused kernels' do, and are held to eager at the type's floor as those are
(:func:`kiln.graph.validation.rtol_floor`). A bf16 training step (BERT-4L, autocast) so
built: every one of its 293 outputs within eager's tolerances at that floor, at 1.6-1.9x
the speed of eager running its graph (11-29).
"""
from __future__ import annotations

import math

import torch

from kiln.engines.base import Engine
from kiln.host import target as host_target

INT32 = (-2**31, 2**31 - 1)
NARROW = {torch.bfloat16: "bf16", torch.float16: "fp16"}      # host_target's names
_NEVER = {torch.complex64: "complex", torch.complex128: "complex",
          torch.float8_e4m3fn: "float8", torch.float8_e5m2: "float8",
          torch.float64: "float64 (OpenVINO's CPU plugin computes it in float32)"}
# Ops that only move, select or compare int64 values (or make indices): in int32
# they give the same answer whenever their inputs fit int32, which the runtime
# checks at every call. Other int64 ops must be proven to stay in int32 (below).
_INT64_SAFE = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "squeeze", "unsqueeze",
    "permute", "transpose", "t", "clone", "alias", "cat", "stack", "index", "_unsafe_index",
    "index_select", "gather", "repeat", "flip", "roll", "split", "split_with_sizes", "narrow",
    "unbind", "where", "masked_fill", "full", "full_like", "zeros", "zeros_like", "ones",
    "ones_like", "scalar_tensor", "arange", "max", "min", "amax", "amin", "maximum", "minimum",
    "argmax", "argmin", "sort", "topk", "constant_pad_nd", "clamp", "_to_copy", "lift_fresh_copy",
    "embedding", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "bitwise_not",
}
# Writes at int64 indices (an embedding's gradient, a one-hot): where the values written are
# not int64 they compute nothing in int64, and their indices fit int32 as the reads' must.
_INDEX_WRITES = {"index_put", "_unsafe_index_put", "scatter", "scatter_add", "scatter_reduce",
                 "index_add", "index_copy", "index_fill"}
_MOVES = _INT64_SAFE - {"arange", "argmax", "argmin", "full", "full_like", "scalar_tensor",
                        "zeros", "zeros_like", "ones", "ones_like", "_to_copy", "bitwise_not"}


def reason(node) -> str | None:
    """Why OpenVINO's CPU plugin would silently change this op's result, if it would."""
    name = node.target.overloadpacket.__name__
    dtypes = set(Engine.dtypes(node))
    for dtype in dtypes:
        if dtype in _NEVER:
            return f"dtype {_NEVER[dtype]} is not supported by kiln's OpenVINO engine"
        if dtype in NARROW and not host_target.native(NARROW[dtype]):
            return (f"{str(dtype).split('.')[-1]} ({NARROW[dtype]}) on a CPU that emulates it: kiln keeps its "
                    "rounding on the host (OpenVINO's plugin would compute it in float32)")
    narrow = dtypes & _NARROW_INTS
    if narrow and name not in _NARROW_INT_MOVES:
        kind = str(min(narrow, key=str)).split(".")[-1]
        return (f"{kind} arithmetic: OpenVINO's CPU plugin computes it in float32 (exact only below 2^24) "
                "and saturates 8-bit sums where PyTorch wraps")
    if torch.int64 not in dtypes:
        return None
    if name in _INDEX_WRITES and _dtype_of(node) not in (None, torch.int64):
        return None     # int64 only as the indices: as safe as the reads (``index``, ``gather``)
    if name not in _INT64_SAFE and not _fits_int32(_range(node)):
        return "int64 arithmetic: OpenVINO's CPU plugin computes int64 in int32, which could overflow"
    if name == "_to_copy" and node.kwargs.get("dtype") == torch.int64 and any(
            _dtype_of(a) is not None and _dtype_of(a).is_floating_point for a in node.all_input_nodes):
        return "float to int64 conversion: OpenVINO's CPU plugin converts to int32, which could overflow"
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (int, float)) and not isinstance(a, bool) and not _fits_int32((a, a)):
            return f"int64 constant {a} is outside int32, which OpenVINO's CPU plugin computes int64 in"
    return None


# int32, int16, int8 and uint8 ops other than moves: OpenVINO's CPU plugin computes them in
# float32 (int32 ``//``, ``%``, ``max``, ``==`` and ``pow`` past 2^24 came out rounded: a row's
# maximum 2^31 - 1 read back as -2^31) and saturates 8-bit arithmetic (uint8 ``100 + 200``: 255,
# PyTorch's 44). Found by probing (12-03); the check on small example values passed.
_NARROW_INTS = {torch.int32, torch.int16, torch.int8, torch.uint8}
_NARROW_INT_MOVES = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "squeeze", "unsqueeze", "permute",
    "transpose", "t", "clone", "alias", "cat", "stack", "index", "_unsafe_index", "index_select", "gather",
    "repeat", "flip", "roll", "split", "split_with_sizes", "narrow", "unbind", "constant_pad_nd",
    "lift_fresh_copy", "embedding", "_to_copy",
}


def may_be_negative(node) -> bool:
    """Whether an integer fx value may hold a negative number, as far as :func:`_range` tells."""
    r = _range(node)
    return r is None or r[0] < 0


def _dtype_of(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _fits_int32(r) -> bool:
    return r is not None and all(math.isfinite(v) for v in r) and INT32[0] <= r[0] and r[1] <= INT32[1]


def _range(a, depth=0):
    """A (lo, hi) bound on the values of an integer fx value, or None when kiln cannot tell.

    Enough interval arithmetic to prove index bookkeeping such as
    ``arange(n) + offset`` stays small; graph inputs are unknown.
    """
    if isinstance(a, bool) or isinstance(a, (int, float)):
        return (a, a)
    if not isinstance(a, torch.fx.Node) or depth > 32:
        return None
    if _dtype_of(a) == torch.bool:
        return (0, 1)
    if a.op != "call_function" or not isinstance(a.target, torch._ops.OpOverload):
        return None
    name, args = a.target.overloadpacket.__name__, a.args
    sub = [_range(x, depth + 1) for x in args if isinstance(x, (torch.fx.Node, int, float))]
    if name == "arange":
        ends = [x for x in args if isinstance(x, (int, float))][:2]
        return (min(0, *ends), max(0, *ends)) if ends else None
    if name in ("full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones", "ones_like"):
        fill = {"zeros": 0, "zeros_like": 0, "ones": 1, "ones_like": 1}.get(name)
        if fill is None:
            fill = next((x for x in args if isinstance(x, (int, float))), None)
        return None if fill is None else (fill, fill)
    if None in sub:
        return None
    if name in _MOVES or name == "_to_copy":
        return (min(r[0] for r in sub), max(r[1] for r in sub)) if sub else None
    if name in ("add", "sub", "mul") and len(sub) == 2:
        (a0, a1), (b0, b1) = sub
        if name == "add":
            return (a0 + b0, a1 + b1)
        if name == "sub":
            return (a0 - b1, a1 - b0)
        products = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
        return (min(products), max(products))
    if name == "neg" and sub:
        return (-sub[0][1], -sub[0][0])
    if name in ("cumsum", "sum") and sub:
        val = args[0].meta.get("val") if isinstance(args[0], torch.fx.Node) else None
        n = val.numel() if isinstance(val, torch.Tensor) else None
        return None if n is None else (min(0, sub[0][0] * n), max(0, sub[0][1] * n))
    return None
