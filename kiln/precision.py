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

from . import target

aten = torch.ops.aten
MATMULT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten.convolution.default}
TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def native(cast_type: str) -> bool:
    return any(f in target.host_features() for f in _NATIVE.get(cast_type, ()))


def native_on_gpu(cast_type: str) -> bool:
    """NVIDIA GPUs compute fp16 on tensor cores since Volta, bf16 since Ampere."""
    if cast_type == "bf16":
        return torch.cuda.is_bf16_supported()
    return cast_type == "fp16"


def lower(gm: torch.fx.GraphModule, mode: str, cast_type: str) -> int:
    """Run the affected ops in ``cast_type`` itself (for engines that compute it
    natively, like Inductor on a GPU): float32 inputs are cast down, the op runs
    in the low type, its result is cast back up so the rest of the graph and
    the model's outputs keep their fp32 types. Ops with several outputs stay
    fp32. Returns how many ops were lowered."""
    dtype = TYPES[cast_type]
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if mode == "matmult" and node.target not in MATMULT_OPS:
            continue
        out = node.meta.get("val")
        if node.target in (aten._to_copy.default,) or not isinstance(out, torch.Tensor) \
                or out.dtype != torch.float32:
            continue
        floats = [a for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == torch.float32]
        if not floats:
            continue
        for arg in floats:
            with gm.graph.inserting_before(node):
                down = gm.graph.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
                down.meta["val"] = arg.meta["val"].to(dtype)
            node.replace_input_with(arg, down)
        node.meta["val"] = out.to(dtype)
        with gm.graph.inserting_after(node):
            up = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float32})
            up.meta["val"] = out
        node.replace_all_uses_with(up, delete_user_cb=lambda user: user is not up)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


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
