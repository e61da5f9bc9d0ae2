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

Whether the fold pays is the CPU's to say, so it is measured (:func:`probe`, timed by
:mod:`kiln.engines.openvino`). The chain above is the Intel Xeon's (AMX). On an AMD EPYC
(AVX-512 with bf16, no AMX) the plugin decompresses weights with float zero points more
slowly than without: the same twenty products at 128 tokens ran 14.0 ms folded against 11.7
ms as pairs, and SmolLM2's prefill graph 93 ms folded against 80.5 ms as pairs (2026-11-30).

Only for builds OpenVINO computes in bf16 or f16 (:mod:`kiln.engines.openvino`): in f32 the
plugin does not quantize the activations of a product with float zero points (it computes
in float, 2e-6 from float64 on the chain above, not 3e-2) and the chain ran 12.4 ms against
the two products' 7.5 ms, so f32 builds keep the pair.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_graph import attr

_MS = "com.microsoft"


def fold_file(path: str, timed=None) -> dict:
    """:func:`fold` on the ONNX model at ``path``, saved back when it changed (weights
    inline below protobuf's 2 GB, beside it in ``path + ".data"`` above). ``timed``, given
    the :func:`shapes` of the products that would fold, says whether folding pays on this
    CPU (``{"fold": bool, ...its timings}``); without it every such product folds.
    Returns ``{"folded": count, ...timed's answer}``."""
    import onnx
    from kiln.engines import ort_quantize
    model = onnx.load(path)
    found = shapes(model) if timed is not None else []
    verdict = timed(found) if found else {}
    if verdict and not verdict["fold"]:
        return {"folded": 0, **verdict}
    count = fold(model)
    if count:
        ort_quantize.save(model, path)
    return {"folded": count, **verdict}


def shapes(model) -> list:
    """``(rows, K, N, count)`` of the products :func:`fold` would fold, one entry per
    shape in the order the graph first has it (``rows``: the activation's leading dims
    multiplied, where the graph knows them, else 1)."""
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    inits = {i.name: i for i in graph.initializer}
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.value_info) + list(graph.input)}
    counts = {}
    for add in graph.node:
        match = _match(add, made, inits)
        if match is not None:
            product = match[0]
            rows = int(np.prod([d or 1 for d in dims.get(product.input[0], [1, 0])[:-1]]))
            key = (rows, attr(product, "K"), attr(product, "N"))
            counts[key] = counts.get(key, 0) + 1
    return [(*key, n) for key, n in counts.items()]


def probe(found: list, limit: int = 40) -> tuple:
    """Two small ONNX models for timing the fold on this CPU, as the pair kiln writes
    (:mod:`kiln.engines.ort_int4`) and folded: a chain of products of ``found``'s shapes
    (``(rows, K, N, count)``) in their proportions, at most ``limit`` of them, random int4
    blocks with a minimum, each product's input the last one's output cut or repeated to
    its width, as a graph's products follow one another (products that all read one input
    and each write an output measured the outputs' conversions instead). Input ``x{rows}``.
    Every shape is timed as int4 blocks, a K-quant's 8-bit kept blocks too: the choice is
    the plugin's way with float zero points, which the bits do not change."""
    import copy
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from kiln.engines import ort_int4
    rng = np.random.default_rng(0)
    scale = min(1.0, limit / sum(f[3] for f in found))
    left = {f[:3]: max(1, round(f[3] * scale)) for f in found}
    inputs, nodes, weights, last = {}, [], [], {}
    while any(left.values()):
        for (rows, k, n), todo in left.items():
            if not todo:
                continue
            left[rows, k, n] -= 1
            if rows not in last:
                inputs[rows] = helper.make_tensor_value_info(f"x{rows}", TensorProto.FLOAT, [rows, k])
                last[rows] = (inputs[rows].name, k)
            value, width = last[rows]
            i = len(nodes)
            if width != k:
                if width < k:
                    nodes.append(helper.make_node("Concat", [value] * -(-k // width), [f"c{i}"], axis=-1))
                    value = f"c{i}"
                for name, v in (("starts", 0), ("ends", k), ("axes", -1)):
                    weights.append(numpy_helper.from_array(np.array([v], np.int64), f"{name}{i}"))
                nodes.append(helper.make_node("Slice", [value, f"starts{i}", f"ends{i}", f"axes{i}"], [f"s{i}"]))
                value = f"s{i}"
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)   # values stay ~1
            weights.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", [value, f"w{i}"], [f"y{i}"], name=f"mm{i}"))
            last[rows] = (f"y{i}", n)
    outputs = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [rows, width]) for rows, (v, width) in last.items()]
    graph = helper.make_graph(nodes, "kiln_zero_point_probe", list(inputs.values()), outputs, weights)
    pair = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    pair = onnx.shape_inference.infer_shapes(pair)         # the activations' ranks, for ort_int4
    ort_int4.apply(pair, [n.name for n in nodes if n.op_type == "MatMul"], 4)
    folded = copy.deepcopy(pair)
    fold(folded)
    return pair, folded


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

