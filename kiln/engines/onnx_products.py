"""How many of a quantized ONNX model's weighted products were quantized, and how many are
left in float: what a quantized build records (the manifest's ``quantized``, ``kiln inspect``).

A build asked for int8 or int4 can come back with fewer quantized products than the user
expects, or none, and still pass the accuracy gate, since float is accurate: the thirty-first
session found an emulated-bf16 int4 build that had quantized nothing (its weights reached the
engine as inputs), noticed only because it was slow. Counting the products in the graph the
engine was given makes that visible, and lets the compiler say so when nothing was quantized.

A product on a GGUF file's own blocks (:mod:`kiln.engines.ort_blocks`) is counted by the
blocks' type too (``blocks``): such a build runs through the int8 quantizer for what its file
does not hold, and would otherwise read as int8 everywhere.

A *weighted product* is a ``MatMul``, ``Gemm`` or ``Conv`` whose weight is a constant of rank 2
or more (products of two activations, attention's scores, never count: kiln does not quantize
them). It is *quantized* when it is one of ONNX Runtime's quantized operators, or a QDQ
product whose weight comes from a ``DequantizeLinear`` (static int8). Products kiln adds to a
quantized graph itself (:mod:`kiln.engines.ort_int4`'s ``/offset`` products, which apply Q4_1's
block minimums to each block's sum) are part of a quantized product, not products of their own.
"""
from __future__ import annotations

QUANTIZED_OPS = frozenset({"MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul",
                           "MatMulIntegerToFloat", "QGemm", "ConvInteger", "QLinearConv"})
FLOAT_OPS = ("MatMul", "Gemm", "Conv")
# A product on kept blocks (kiln.engines.ort_blocks) says so in its node's doc string, followed
# by the blocks' type
BLOCKS_DOC = "kiln kept blocks: "
# ort_int4's block-minimum products, named <product>/offset (kiln.engines.ort_int4)
_AUXILIARY_SUFFIX = "/offset"


def count(model) -> dict:
    """``{"quantized": n, "float": n, "ops": {op_type: n}, "float_ops": {op_type: n}}`` for
    ``model`` (an ``onnx.ModelProto``; its weights need not be loaded): the quantized products
    and those left in float, each by operator; and ``"blocks": {type: n}`` where some are on
    kept blocks."""
    graph = model.graph
    rank = {i.name: len(i.dims) for i in graph.initializer}
    dequantized = {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    ops: dict = {}
    floats: dict = {}
    blocks: dict = {}
    for node in graph.node:
        if node.op_type in QUANTIZED_OPS:
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
            if node.doc_string.startswith(BLOCKS_DOC):
                kind = node.doc_string[len(BLOCKS_DOC):]
                blocks[kind] = blocks.get(kind, 0) + 1
        elif node.op_type in FLOAT_OPS and len(node.input) > 1:
            if node.input[1] in dequantized:
                ops["QDQ " + node.op_type] = ops.get("QDQ " + node.op_type, 0) + 1
            elif rank.get(node.input[1], 0) >= 2 and not node.name.endswith(_AUXILIARY_SUFFIX):
                floats[node.op_type] = floats.get(node.op_type, 0) + 1
    out = {"quantized": sum(ops.values()), "float": sum(floats.values()), "ops": dict(sorted(ops.items())),
           "float_ops": dict(sorted(floats.items()))}
    if blocks:
        out["blocks"] = dict(sorted(blocks.items()))
    return out

