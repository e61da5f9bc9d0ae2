"""ONNX Runtime's transformer fusions on partitions from torch's dynamo exporter.

The ``transformers`` variant of the ONNX Runtime engine runs
``onnxruntime.transformers.optimizer.optimize_model`` (model type ``bert``) on the
exported partition before ORT's own session optimisation.

What it still adds is small. Capture keeps attention whole and partitions are exported
at opset 23 (:data:`kiln.engines.onnxruntime.EXPORT_OPSET`), so attention already is one
``Attention`` op, and ORT's session optimiser fuses SkipLayerNormalization and Gelu by
itself; the optimizer's contribution is folding each FFN's bias into ``BiasGelu``.
Measured on the 2-core AVX2 machine: 1-2 % on all-MiniLM-L6-v2 and BERT-base, within the
run-to-run noise; -O3 builds it and keeps it only when it times faster.

It needs one exact rewrite first: core ATen spells every linear layer as a 2-D
``addmm`` between two reshapes, exported as ``Reshape → Gemm``, where the fusions look
for ``MatMul`` + ``Add`` on the 3-D activation; ``Reshape → Gemm`` on a 3-D activation
becomes that.
"""
from __future__ import annotations

import collections

from kiln.engines.ort_rewrites import GraphIndex
from kiln.quiet import EXPORTER_LOGGERS, quiet

FUSED = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization",
         "BiasGelu", "FastGelu", "Gelu", "GemmFastGelu", "LayerNormalization")


def optimize(path: str, out: str) -> dict:
    """Rewrite and fuse the model at ``path`` into ``out``; the fused op counts."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model
    model = onnx.load(path)
    rewrites = {"gemm": _gemm_3d(model)}
    with quiet(EXPORTER_LOGGERS + ("root", "onnxruntime", "onnxruntime.transformers")):
        opt = optimize_model(model, model_type="bert", num_heads=0, hidden_size=0, opt_level=0,
                             use_gpu=False, only_onnxruntime=False,
                             optimization_options=FusionOptions("bert"))
    opt.save_model_to_file(out, use_external_data_format=True, all_tensors_to_one_file=True)
    counts = collections.Counter(n.op_type for n in opt.model.graph.node)
    return {"fused": {k: counts[k] for k in FUSED if counts[k]}, "rewrites": rewrites}


def _shapes(model) -> dict:
    import onnx
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info):
        dims = v.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[v.name] = [d.dim_value for d in dims]
    return shapes


def _gemm_3d(model) -> int:
    """Reshape(x: [B, S, K] → [B*S, K]) → Gemm(W, b) becomes MatMul(x, W) + b on 3-D x.

    The Gemm's output keeps its name and its [B*S, N] shape through the reshape that
    follows it in the exporter's graphs, so nothing downstream changes. Only plain
    Gemms (alpha = beta = 1, no transA) with constant weights are rewritten.
    """
    from onnx import helper, numpy_helper
    graph = model.graph
    index = GraphIndex(graph, shapes=_shapes(model))
    shapes, inits = index.shapes, index.initializers
    producer, consumers, outputs = index.producer, index.consumers, index.outputs
    dropped, new_nodes, count = set(), [], 0
    for n in graph.node:
        if n.output and n.output[0] in dropped:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        src = producer.get(n.input[0]) if n.op_type == "Gemm" else None
        x = src.input[0] if src is not None and src.op_type == "Reshape" else None
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
        xs, ys = shapes.get(x), shapes.get(n.output[0])
        if x is None or not plain or n.input[1] not in inits or xs is None or ys is None or len(xs) != 3 \
                or (len(n.input) > 2 and n.input[2] and n.input[2] not in inits):
            new_nodes.append(n)
            continue
        weight = n.input[1]
        if attrs.get("transB", 0):
            t = numpy_helper.to_array(inits[weight]).T.copy()
            weight = f"{weight}__kiln_t"
            if weight not in inits:
                inits[weight] = numpy_helper.from_array(t, weight)
                graph.initializer.append(inits[weight])
        if len(numpy_helper.to_array(inits[weight]).shape) != 2:
            new_nodes.append(n)
            continue
        out3 = f"{n.output[0]}__kiln_3d"
        after = consumers[n.output[0]]
        reshape = (after[0] if len(after) == 1 and after[0].op_type == "Reshape"
                   and n.output[0] not in outputs else None)
        target = shapes.get(reshape.output[0]) if reshape is not None else None
        fold = target is not None
        if target == xs[:2] + ys[1:]:    # the reshape back to 3-D is now a no-op: drop it
            out3 = reshape.output[0]
            dropped.add(out3)
        elif fold:                       # reshape the 3-D result straight to its target
            shape = numpy_helper.from_array(_i64(target), f"{reshape.output[0]}__kiln_shape")
            graph.initializer.append(shape)
            reshape.input[0], reshape.input[1] = out3, shape.name
        bias = len(n.input) > 2 and n.input[2]
        mm = f"{out3}_mm" if bias else out3
        new_nodes.append(helper.make_node("MatMul", [x, weight], [mm], name=f"{n.name}__kiln_mm"))
        if bias:
            new_nodes.append(helper.make_node("Add", [mm, n.input[2]], [out3], name=f"{n.name}__kiln_bias"))
        if not fold:
            shape = numpy_helper.from_array(_i64(ys), f"{n.output[0]}__kiln_shape")
            graph.initializer.append(shape)
            new_nodes.append(helper.make_node("Reshape", [out3, shape.name], [n.output[0]], name=n.name))
        count += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    return count


def _i64(values):
    import numpy as np
    return np.asarray(values, dtype=np.int64)
