"""Auto-cast: Neuron's ``--auto-cast`` precision policy on CPUs and GPUs.

On a CUDA device the affected ops are rewritten to run in the type
(``lower``): Inductor then generates bf16/fp16 tensor-core kernels.

Where the CPU computes in the requested type natively (bf16 on AVX512-BF16/AMX,
fp16 on AVX512-FP16/AMX-FP16), the engine is asked to run in it. Where it does
not (our AVX2/AVX-512F machines have no bf16), kiln *emulates* the rounding:
the inputs of the cast ops are rounded to the type and back to fp32 while the
arithmetic accumulates in fp32, so users see the accuracy a bf16 chip would
give them. Emulation is slower than fp32, never faster, and says so.
"""
from __future__ import annotations

import operator

import torch

from kiln.host import target

aten = torch.ops.aten
MATMULT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten.convolution.default,
               aten.scaled_dot_product_attention.default}   # kept whole by capture: two matmuls
TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
native = target.native   # the host decides (engines ask it there); the compiler asks here


def native_on_gpu(cast_type: str) -> bool:
    """NVIDIA GPUs compute fp16 on tensor cores since Volta, bf16 since Ampere."""
    if cast_type == "bf16":
        return torch.cuda.is_bf16_supported()
    return cast_type == "fp16"


def _affected(gm: torch.fx.GraphModule, mode: str):
    """The ops --auto-cast applies to: matmuls and convolutions (``matmult``) or every op (``all``)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target in (operator.getitem, aten._to_copy.default):
            continue
        if mode == "matmult" and node.target not in MATMULT_OPS:
            continue
        yield node


def _fp32_inputs(node) -> list:
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == torch.float32]


def _cast(gm, arg, dtype, val):
    """A ``_to_copy(arg, dtype)`` node, inserted at the graph's current insertion point."""
    node = gm.graph.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
    node.meta["val"] = val.to(dtype)
    return node


def _finish(gm, count: int) -> int:
    gm.graph.lint()
    gm.recompile()
    return count


def lower(gm: torch.fx.GraphModule, mode: str, cast_type: str) -> int:
    """Run the affected ops in ``cast_type`` itself (for engines that compute it
    natively, like Inductor on a GPU): float32 inputs are cast down, the op runs
    in the low type, its result is cast back up so the rest of the graph and
    the model's outputs keep their fp32 types. Ops with several outputs stay
    fp32. Returns how many ops were lowered."""
    dtype = TYPES[cast_type]
    count = 0
    for node in _affected(gm, mode):
        out = node.meta.get("val")
        floats = _fp32_inputs(node)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not floats:
            continue
        for arg in floats:
            with gm.graph.inserting_before(node):
                node.replace_input_with(arg, _cast(gm, arg, dtype, arg.meta["val"]))
        node.meta["val"] = out.to(dtype)
        with gm.graph.inserting_after(node):
            up = _cast(gm, node, torch.float32, out)
        node.replace_all_uses_with(up, delete_user_cb=lambda user: user is not up)
        count += 1
    return _finish(gm, count)


def emulate(gm: torch.fx.GraphModule, mode: str, cast_type: str, keep_constants: bool = False) -> int:
    """Round the float32 inputs of the affected ops through ``cast_type``; return how many.
    ``keep_constants`` (a quantized build): inputs computed from the model's constants alone
    (weights, and their transposes) are left as they are, for the quantizer to replace.
    Rounded, they were computed on the host (where kiln keeps emulated rounding) and reached
    the engine as inputs, not constants, so no product was quantized: an int4 build of a
    two-layer model came back in float32, in four partitions, with nothing said."""
    dtype = TYPES[cast_type]
    count = 0
    constant = _constant_nodes(gm) if keep_constants else set()
    for node in _affected(gm, mode):
        floats = [a for a in _fp32_inputs(node) if a not in constant]
        for arg in floats:
            val = arg.meta["val"]
            with gm.graph.inserting_before(node):
                node.replace_input_with(arg, _cast(gm, _cast(gm, arg, dtype, val), torch.float32, val))
        count += bool(floats)
    return _finish(gm, count)


def _constant_nodes(gm: torch.fx.GraphModule) -> set:
    """The nodes whose value the model's constants alone decide (``get_attr`` and ops on
    nothing else)."""
    constant = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op == "call_function" and node.all_input_nodes
                                     and all(a in constant for a in node.all_input_nodes)):
            constant.add(node)
    return constant
