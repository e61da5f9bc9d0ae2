"""Weight products that read the same activation, merged into one before quantization.

A Llama layer multiplies one normalised activation by three weights (query, key, value)
and another by two (gate, up). As separate ``MatMulNBits`` each call quantizes the same
activation to int8 again (accuracy level 4), dispatches on its own and, for kiln's Q4_1
int4 (:mod:`kiln.engines.ort_int4`), adds its own offset product and ``Add``. Joined
along the output dim (``[K, N1] | [K, N2] -> [K, N1 + N2]``) they are one product and a
``Split``: SmolLM2's layer goes from seven weight products to four.

Exact: the weights are only placed side by side. Quantization works on blocks along the
input dim of each output column, so every column gets the same blocks as before, and an
output column's dot product does not depend on which other columns share the call.
"""
from __future__ import annotations

import collections

import numpy as np

from kiln.engines import ort_rewrites


def merge(model, nodes: list) -> list:
    """Merge the constant-weight ``MatMul`` nodes named in ``nodes`` that share their
    activation input, in ``model`` (an ``onnx.ModelProto``) in place; the wanted node names
    afterwards (merged nodes under a new name, the others as they were)."""
    from onnx import helper, numpy_helper
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    wanted = set(nodes)
    groups = collections.defaultdict(list)
    for n in graph.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and n.name in wanted else None
        if w is not None and len(w.dims) == 2 and _float(w):
            groups[(n.input[0], w.dims[0], w.data_type)].append(n)
    joined = {id(group[0]): group for group in groups.values() if len(group) > 1}
    members = {id(n) for group in joined.values() for n in group}
    out, names = [], [n for n in nodes if all(n != m.name for g in joined.values() for m in g)]
    for n in graph.node:
        if id(n) not in members:
            out.append(n)
            continue
        group = joined.get(id(n))
        if group is None:                  # a later member: written with the first
            continue
        name = "/".join(m.name for m in group[:1]) + "/kiln_merged"
        weights = [numpy_helper.to_array(inits[m.input[1]]) for m in group]
        graph.initializer.extend([numpy_helper.from_array(np.concatenate(weights, axis=1), name + "/weight"),
                                  numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64),
                                                          name + "/split")])
        out.append(helper.make_node("MatMul", [n.input[0], name + "/weight"], [name + "/out"], name=name))
        out.append(helper.make_node("Split", [name + "/out", name + "/split"], [m.output[0] for m in group],
                                    name=name + "/split", axis=-1))
        names.append(name)
    if not joined:
        return list(nodes)
    ort_rewrites.replace_nodes(model, out)
    return names


def _float(init) -> bool:
    from onnx import TensorProto
    return init.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
