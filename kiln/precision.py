"""Auto-cast: Neuron's ``--auto-cast`` precision policy on CPUs.

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

from . import target

aten = torch.ops.aten
MATMULT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten.convolution.default}
TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def native(cast_type: str) -> bool:
    return any(f in target.host_features() for f in _NATIVE.get(cast_type, ()))


def emulate(gm: torch.fx.GraphModule, mode: str, cast_type: str) -> int:
    """Round the float32 inputs of the affected ops through ``cast_type``; return how many."""
    dtype = TYPES[cast_type]
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if mode == "matmult" and node.target not in MATMULT_OPS:
            continue
        if node.target in (aten._to_copy.default,):
            continue
        rounded = {}
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
                continue
            with gm.graph.inserting_before(node):
                down = gm.graph.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
                down.meta["val"] = val.to(dtype)
                up = gm.graph.call_function(aten._to_copy.default, (down,), {"dtype": torch.float32})
                up.meta["val"] = val
            rounded[arg] = up
        for arg, up in rounded.items():
            node.replace_input_with(arg, up)
        count += bool(rounded)
    gm.graph.lint()
    gm.recompile()
    return count
