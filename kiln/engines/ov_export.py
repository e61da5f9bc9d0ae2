"""What OpenVINO's compiled-model export gets wrong, and how kiln keeps it from an artifact.

A compiled OpenVINO partition is stored as the CPU plugin's own export and imported at load
(:mod:`kiln.engines.openvino`), so the model that answers a user is the imported one, not
the one compiled. OpenVINO 2026.4 imports ONNX's ``RotaryEmbedding`` wrongly: its CPU
plugin turns the op into a ``RoPE`` node whose settings do not survive export, and the
imported node computes garbage (errors of 0.5 up to 1e35 on a rotary table of any shape),
while the model it was exported from is exact. torch's exporter writes that op for small
graphs it optimises (a 2-layer Llama's prefill), so a tiny int4 Llama's prefill on
OpenVINO answered wrongly after import on every build: its keys at the last position 0.5
off on some builds (cosine 0.95 against eager, within a lossy build's slack) and up to 1e35
on others (cosine 0.05). transformers' own rotate-half arithmetic, which OpenVINO keeps as
plain ops, round trips exactly.

* :func:`decompose_rotary` writes each such op of the ONNX model OpenVINO reads (the
  quantized road) as that arithmetic: ``x1*cos - x2*sin`` and ``x2*cos + x1*sin`` on the
  two halves, the op's own definition.
* :func:`check_round_trip` runs a lossy build's compiled and imported models on the
  partition's example inputs and refuses the build when they differ. A lossy build (int8,
  int4, auto-cast) is held only loosely against eager partition by partition
  (:mod:`kiln.compiler.checks`), so an import that answers a little wrong could otherwise
  pass; an exact build is already checked against eager through its import.
"""
from __future__ import annotations

import io

import numpy as np


def decompose_rotary(model) -> int:
    """Rewrite ``model``'s (an ``onnx.ModelProto``) 4-D, non-interleaved, full-width
    ``RotaryEmbedding`` nodes without position ids in place; the number rewritten. Others
    are left as they are (the round trip check then decides)."""
    from onnx import helper, shape_inference
    if not any(n.op_type == "RotaryEmbedding" and not n.domain for n in model.graph.node):
        return 0
    ranks = _ranks(shape_inference.infer_shapes(model).graph)
    nodes, count = [], 0
    for node in model.graph.node:
        if not _plain_rotary(node, ranks):
            nodes.append(node)
            continue
        x, cos, sin = node.input[:3]
        p = f"{node.name or node.output[0]}/kiln_rotary"
        one = f"{p}/axis1"
        model.graph.initializer.append(helper.make_tensor(one, 7, [1], [1]))       # int64
        cos4, sin4, x1, x2 = (f"{p}/{s}" for s in ("cos4", "sin4", "x1", "x2"))
        terms = [f"{p}/t{k}" for k in range(4)]
        y1, y2 = f"{p}/y1", f"{p}/y2"
        nodes += [helper.make_node("Unsqueeze", [cos, one], [cos4], name=f"{p}/unsqueeze_cos"),
                  helper.make_node("Unsqueeze", [sin, one], [sin4], name=f"{p}/unsqueeze_sin"),
                  helper.make_node("Split", [x], [x1, x2], axis=-1, num_outputs=2, name=f"{p}/split"),
                  helper.make_node("Mul", [x1, cos4], [terms[0]], name=f"{p}/mul0"),
                  helper.make_node("Mul", [x2, sin4], [terms[1]], name=f"{p}/mul1"),
                  helper.make_node("Sub", terms[:2], [y1], name=f"{p}/sub"),
                  helper.make_node("Mul", [x2, cos4], [terms[2]], name=f"{p}/mul2"),
                  helper.make_node("Mul", [x1, sin4], [terms[3]], name=f"{p}/mul3"),
                  helper.make_node("Add", terms[2:], [y2], name=f"{p}/add"),
                  helper.make_node("Concat", [y1, y2], [node.output[0]], axis=-1, name=f"{p}/concat")]
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def _ranks(graph) -> dict:
    ranks = {}
    for v in list(graph.value_info) + list(graph.input) + list(graph.output):
        t = v.type.tensor_type
        if t.HasField("shape"):
            ranks[v.name] = len(t.shape.dim)
    return ranks


def _plain_rotary(node, ranks) -> bool:
    from onnx import helper
    if node.op_type != "RotaryEmbedding" or node.domain:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (attrs.get("interleaved", 0) == 0 and attrs.get("rotary_embedding_dim", 0) == 0
            and (len(node.input) < 4 or not node.input[3]) and ranks.get(node.input[0]) == 4)


def check_round_trip(core, compiled, exported: bytes, config: dict, example_inputs, runner) -> None:
    """Raise RuntimeError when the export of ``compiled`` answers differently after import
    (both run by ``runner``, :class:`kiln.engines.openvino.OvRunner`).

    The same kernels on the same inputs give the same numbers; the bound allows a
    thread schedule's reordered sums (1e-4 of the output's scale), far under the errors an
    import bug makes."""
    import openvino as ov
    imported = core.import_model(ov.Tensor(np.frombuffer(exported, dtype=np.uint8)), "CPU", config)
    inputs = list(example_inputs)
    for i, (a, b) in enumerate(zip(runner(compiled)(inputs), runner(imported)(inputs))):
        same = a == b
        if a.is_floating_point():
            a, b = a.double(), b.double()
            finite = a[a.isfinite()]
            scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1e-6)
            same |= ((a - b).abs() <= 1e-4 * scale) | (a.isnan() & b.isnan())
        if not bool(same.all()):
            raise RuntimeError(
                f"OpenVINO's exported model answers differently after import (output {i}), so the "
                "artifact would not give the answers checked at compile time; this partition is "
                "left to another engine")


def export(compiled) -> bytes:
    out = io.BytesIO()
    compiled.export_model(out)
    return out.getvalue()
