"""Blocks with a float minimum as OpenVINO's compressed weights with float zero points.

ONNX Runtime's ``MatMulNBits`` takes integer zero points only (its float form falls back to
dequantizing), so kiln writes a block with a float offset, GGUF's Q4_1/Q5_1/K-quants'
``w = d * q + m`` (:mod:`kiln.engines.ort_int4`, :mod:`kiln.engines.ort_blocks`), as two
products: ``MatMulNBits(x; u, scale)`` plus ``block_sums(x) @ offsets``. OpenVINO reads the
same ONNX model; its CPU plugin decompresses weights with a zero point of any float value,
so for it the pair is one product again::

    scale * (u - 2**(bits-1)) + offset  ==  scale * (u - z),  z = 2**(bits-1) - offset / scale

which its ONNX frontend reads from ``MatMulNBits`` with float ``zero_points``. On SmolLM2's
int4 128-token prefill graph that halves the graph's products (211 instead of 421, and 2,507
compiled operations instead of 4,517). A chain of twenty 576x1536 Q4_1 products at 128
tokens, bf16 with activations quantized in groups of 32, ran 3.11 ms against 4.30 ms,
imported in 42 against 65 ms, and landed closer to the float64 answer (1.1e-2 relative
against 1.6e-2). ``z`` is rounded to float32: the weights it stands for differ from the
blocks' by about one float32 rounding of the offset, far below what bf16 rounds away. A
block whose scale is 0 (every weight its offset) has no such ``z``; its product is left as
it was. ONNX Runtime's own graphs are not touched.

Only for builds OpenVINO computes in bf16 or f16 (:mod:`kiln.engines.openvino`): in f32 the
plugin does not quantize the activations of a product with float zero points (it computes
in float, 2e-6 from float64 on the chain above, not 3e-2) and the chain ran 12.4 ms against
the two products' 7.5 ms, so f32 builds keep the pair.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_graph import attr

_MS = "com.microsoft"


def fold_file(path: str) -> int:
    """:func:`fold` on the ONNX model at ``path``, saved back when it changed (weights
    inline below protobuf's 2 GB, beside it in ``path + ".data"`` above)."""
    import onnx
    from kiln.engines import ort_quantize
    model = onnx.load(path)
    count = fold(model)
    if count:
        ort_quantize.save(model, path)
    return count


def fold(model) -> int:
    """Fold every offset product of ``model`` (an ``onnx.ModelProto``, weights in memory)
    into its ``MatMulNBits`` as float zero points, in place; how many were folded."""
    from onnx import numpy_helper
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    gone, folded = set(), 0
    for add in list(graph.node):
        match = _match(add, made, inits)
        if match is None:
            continue
        product, offset_mm, offsets = match
        bits = attr(product, "bits")
        scales = numpy_helper.to_array(inits[product.input[2]]).astype(np.float32)
        n, nb = attr(product, "N"), attr(product, "K") // attr(product, "block_size")
        per_block = scales.reshape(n, nb)
        if not np.all(np.isfinite(per_block)) or np.any(per_block == 0):
            continue
        zero = np.float32(1 << (bits - 1)) - numpy_helper.to_array(offsets).astype(np.float32).T / per_block
        if not np.all(np.isfinite(zero)):
            continue
        name = product.name + "/kiln_zero_points"
        graph.initializer.append(numpy_helper.from_array(zero.astype(np.float32).reshape(scales.shape), name))
        product.input.append(name)
        product.output[0] = add.output[0]
        gone.update((id(add), id(offset_mm)))
        folded += 1
    if folded:
        kept = [n for n in graph.node if id(n) not in gone]
        del graph.node[:]
        graph.node.extend(_without_dead_sums(kept, {o.name for o in graph.output}))
        used = {i for n in graph.node for i in n.input}
        for index in reversed([k for k, i in enumerate(graph.initializer) if i.name not in used]):
            del graph.initializer[index]        # by index: no copies, no comparisons of weights
    return folded


def _match(add, made, inits):
    """``(MatMulNBits, offset MatMul, offsets initializer)`` when ``add`` sums a product
    without zero points and ``block_sums(x) @ offsets`` of that product's own input and
    blocks, else None."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    for a, b in (tuple(add.input), tuple(reversed(add.input))):
        product, offset_mm = made.get(a), made.get(b)
        if (product is None or offset_mm is None or product.op_type != "MatMulNBits"
                or product.domain != _MS or len(product.input) != 3 or offset_mm.op_type != "MatMul"):
            continue
        offsets = inits.get(offset_mm.input[1])
        block, k, n = attr(product, "block_size"), attr(product, "K"), attr(product, "N")
        if offsets is None or list(offsets.dims) != [k // block, n] or k % block:
            continue
        if _sums_of(made, inits, offset_mm.input[0], block) == product.input[0]:
            return product, offset_mm, offsets
    return None


def _sums_of(made, inits, value, block):
    """The tensor whose per-``block`` sums over its last dim ``value`` is
    (``ReduceSum(Reshape(x, [..., K / block, block]), -1)``), else None."""
    from onnx import numpy_helper
    reduce = made.get(value)
    if reduce is None or reduce.op_type != "ReduceSum" or len(reduce.input) != 2 or attr(reduce, "keepdims", 1):
        return None
    axes, reshape = inits.get(reduce.input[1]), made.get(reduce.input[0])
    if axes is None or reshape is None or reshape.op_type != "Reshape":
        return None
    shape = inits.get(reshape.input[1])
    if shape is None or numpy_helper.to_array(axes).tolist() != [-1] or numpy_helper.to_array(shape)[-1] != block:
        return None
    return reshape.input[0]


def _without_dead_sums(nodes, outputs):
    """``nodes`` less the block sums nothing reads any more (a sum is shared by every
    product of one activation, so it goes only when the last of them was folded)."""
    while True:
        used = {i for n in nodes for i in n.input} | outputs
        dead = {id(n) for n in nodes if n.op_type in ("ReduceSum", "Reshape") and "block_sums" in n.output[0]
                and not any(o in used for o in n.output)}
        if not dead:
            return nodes
        nodes = [n for n in nodes if id(n) not in dead]

