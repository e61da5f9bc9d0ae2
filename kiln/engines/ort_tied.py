"""A token embedding read from the output projection's 8-bit blocks, when they hold it exactly.

A Llama with tied embeddings (SmolLM2) multiplies by the embedding matrix twice: as the
output projection, which weight-only quantization turns into ``MatMulNBits`` blocks (int8
in blocks of 32: GGUF's Q8_0, exact for weights that came from one), and as the token
``Gather`` at the start of the step, which kept the float32 matrix: 113 MB of SmolLM2's
decode graph against 28 MB of blocks, in every graph of the artifact.

Where the blocks dequantize to that float32 matrix bit for bit (checked here, on the
values), the ``Gather`` becomes ONNX Runtime's ``GatherBlockQuantized`` over the same
blocks and scales: ``(q - 128) * scale`` per element, the very product the float32 matrix
holds, so the step's answers do not change by a bit. The gather reads the blocks as
``[rows, width]`` and an initializer has one shape, so the graph holds them twice (28 MB
for SmolLM2, against the 113 MB matrix they replace; the scales are shared). The two are
the same bytes, so an LLM's saved artifact stores them once (:mod:`kiln.runtime.ort_pool`).
Anywhere else (kiln's own int8 of a float model, whose blocks only approximate the matrix)
the ``Gather`` is left alone.
"""
from __future__ import annotations

import numpy as np

from kiln.engines import ort_rewrites
from kiln.engines.ort_graph import attr


def share_embedding(model) -> int:
    """Rewrite, in place, each ``Gather`` of a float32 matrix that some 8-bit ``MatMulNBits``
    holds exactly (module doc); how many were rewritten."""
    from onnx import TensorProto, helper, numpy_helper
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    products = [n for n in graph.node if n.op_type == "MatMulNBits" and attr(n, "bits") == 8
                and (len(n.input) < 4 or not n.input[3]) and n.input[1] in inits and n.input[2] in inits]
    out, count = [], 0
    for n in graph.node:
        table = inits.get(n.input[0]) if n.op_type == "Gather" and attr(n, "axis", 0) == 0 else None
        match = None
        if table is not None and table.data_type == TensorProto.FLOAT and len(table.dims) == 2:
            match = next((p for p in products if _holds(p, table, inits)), None)
        if match is None:
            out.append(n)
            continue
        rows, width = table.dims
        block = attr(match, "block_size")
        name = match.input[1] + "/kiln_gather"
        scales = match.input[2]
        if list(inits[scales].dims) != [rows, width // block]:
            scales = name + "/scales"       # the product's scales in another shape: a copy
        if name not in inits:       # the same bytes as [rows, width], the layout the gather reads
            q = numpy_helper.to_array(inits[match.input[1]]).reshape(rows, width)
            graph.initializer.append(numpy_helper.from_array(q, name))
            if scales != match.input[2]:
                graph.initializer.append(numpy_helper.from_array(
                    numpy_helper.to_array(inits[match.input[2]]).reshape(rows, width // block), scales))
            inits[name] = True
        out.append(helper.make_node("GatherBlockQuantized", [name, n.input[1], scales],
                                    list(n.output), name=n.name + "/kiln_blocks", domain="com.microsoft",
                                    bits=8, block_size=block, gather_axis=0, quantize_axis=1))
        count += 1
    if count:               # the float matrix, read by nothing else now, is dropped with it
        ort_rewrites.replace_nodes(model, out, microsoft=True)
    return count


def _holds(product, table, inits) -> bool:
    """Whether ``product``'s blocks dequantize to ``table`` (``[N, K]``) bit for bit."""
    from onnx import numpy_helper
    rows, width = table.dims
    if attr(product, "N") != rows or attr(product, "K") != width:
        return False
    block = attr(product, "block_size")
    q = numpy_helper.to_array(inits[product.input[1]])
    scales = numpy_helper.to_array(inits[product.input[2]])
    if q.dtype != np.uint8 or q.size != rows * width or scales.size != rows * (width // block) \
            or scales.dtype != np.float32 or width % block:
        return False
    values = (q.reshape(rows, width // block, block).astype(np.float32) - 128.0) \
        * scales.reshape(rows, width // block, 1)
    return np.array_equal(values.reshape(rows, width).view(np.uint32),
                          numpy_helper.to_array(table).view(np.uint32))

