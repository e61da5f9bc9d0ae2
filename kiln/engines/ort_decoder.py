"""A decoder step's attention block on ONNX Runtime's fused operators.

Why: at one token per row a decoder step is a chain of small ops whose cost is mostly
their dispatch. kiln's SmolLM2-135M int4 decode step was 1,912 nodes after ORT's own
optimiser; ONNX Runtime GenAI's graph of the same model is 343 (``RotaryEmbedding``,
``GroupQueryAttention``, ``SkipSimplifiedLayerNormalization``) and, with the same
``MatMulNBits`` kernels taking the same time, decoded 1.8x faster on the 2-core machine.
What differs is some 60 small ops a layer: rotary embeddings written out as ``Split``,
``Neg``, ``Concat``, two ``Mul`` and an ``Add`` per query and key, and kiln's cached
attention (:func:`kiln.llm.decoder.cached_attention`) as two score products, ``Concat``,
``Where``, ``Softmax``, ``Split``, two value products, ``Add`` and the reshapes between.

These rewrites run on the graph ORT's optimiser has saved (constants folded; at level
``all`` products fused too, and both forms are matched); each matches only what it can
prove equal (the attention, given the runtime's prefix masks):

* ``rotary``: ``x * cos + rotate_half(x) * sin`` with tables that are one half repeated
  (``Cos(Concat(f, f))``, as transformers builds them) becomes ONNX's ``RotaryEmbedding``
  with the half tables; the same products, summed in the same order.
* ``attention``: kiln's cached attention at one new token per row (the decode steps)
  becomes ``com.microsoft.GroupQueryAttention`` over each row's valid slots, with the
  query, key and value as the ``[B, 1, heads * D]`` products they come out of (rotary runs
  on that form too). It reads the valid-slot mask as a count, which is exact for the
  prefix masks the runtime makes, and writes the step's keys into the cache in place
  (:mod:`kiln.engines.ort_gqa` says where that holds and how it is kept safe). Each
  (row, head) is computed on its own, so a row's answer does not depend on the batch.
* ``skip_norm``: a residual ``Add`` feeding an RMS norm becomes
  ``SkipSimplifiedLayerNormalization``, which returns the sum too.

What matched is counted for the blob's header; the graph is then checked against eager
PyTorch like every compiled partition. On SmolLM2's int4 decode step all three match in
every layer: 1,912 nodes become 980. Generating 128 tokens alone on the loaded 2-core
machine (engine threads not spinning, two alternating rounds) took 3.3 instead of 3.9-4.4 s
of CPU, and eight 64-token chats at once 3.5 instead of 3.8 s. What is left between it and
ORT GenAI's graph is mostly the Q4_1 offset products (:mod:`kiln.engines.ort_int4`, about
a tenth of a step's CPU time).
"""
from __future__ import annotations

import numpy as np

from kiln.engines import ort_gqa
from kiln.engines.ort_graph import MS, Graph, attr, scalar, single_user

_RMS = {("", "RMSNormalization"), ("", "SimplifiedLayerNormalization"), (MS, "SimplifiedLayerNormalization")}


def fuse(model) -> dict:
    """Apply the rewrites to ``model`` (an optimised ``onnx.ModelProto``) in place; counts by name."""
    g = Graph(model.graph)
    counts = {"rotary": _rotary(g), "skip_norm": _skip_norm(g)}
    counts["attention"] = ort_gqa.fuse(g)
    if any(counts.values()):
        g.commit()
        if not any(o.domain == MS for o in model.opset_import):
            from onnx import helper
            model.opset_import.append(helper.make_opsetid(MS, 1))
    return {k: v for k, v in counts.items() if v}


# -- rotary ---------------------------------------------------------------------------

def _rotary(g) -> int:
    """``Add(Mul(x, cos4), Mul(Concat(Neg(x2), x1), sin4))`` with ``x1, x2 = Split(x)`` in
    halves -> ``RotaryEmbedding(x, cos_half, sin_half)`` (4-D ``[B, H, T, D]`` form)."""
    count, halves = 0, {}
    for neg in [n for n in g.nodes if n.op_type == "Neg"]:
        match = _match_rotary(g, neg)
        if match is None:
            continue
        x, parts, cos4, sin4, add = match
        tables = [halves.get(t) or halves.setdefault(t, _half_table(g, t)) for t in (cos4, sin4)]
        if None in tables:
            continue
        g.remove(*parts)
        g.add("RotaryEmbedding", [x, *tables], [add.output[0]], interleaved=0)
        count += 1
    return count


def _match_rotary(g, neg):
    cat = single_user(g, neg.output[0], "Concat")
    if cat is None or len(cat.input) != 2 or cat.input[0] != neg.output[0] or attr(cat, "axis") not in (-1, 3):
        return None
    halves = _halves(g, neg.input[0], cat.input[1])
    if halves is None:
        return None
    x, cut = halves
    mul_sin = single_user(g, cat.output[0], "Mul")
    add = single_user(g, mul_sin.output[0], "Add") if mul_sin is not None else None
    if add is None:
        return None
    mul_cos = g.producer.get(next((i for i in add.input if i != mul_sin.output[0]), ""))
    if mul_cos is None or mul_cos.op_type != "Mul" or x not in mul_cos.input or len(g.users(mul_cos.output[0])) != 1:
        return None
    if len(g.users(cat.input[1])) != 1:
        return None
    sin4 = next(i for i in mul_sin.input if i != cat.output[0])
    cos4 = next(i for i in mul_cos.input if i != x)
    return x, (*cut, neg, cat, mul_sin, mul_cos, add), cos4, sin4, add


def _halves(g, second, first):
    """``(x, nodes)`` where ``first, second`` are the halves of ``x`` along its last axis
    (``[B, H, T, D]``), cut by one ``Split`` or two ``Slice`` nodes; else None."""
    split = g.producer.get(second)
    if split is not None and split.op_type == "Split":
        sizes = g.const(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        equal = (sizes.size == 2 and int(sizes[0]) == int(sizes[1])) if sizes is not None \
            else attr(split, "num_outputs") == 2
        if list(split.output) != [first, second] or attr(split, "axis") not in (-1, 3) or not equal:
            return None
        return split.input[0], [split]
    cuts = [g.op(v, "Slice") for v in (first, second)]
    if None in cuts or cuts[0].input[0] != cuts[1].input[0]:
        return None
    x = cuts[0].input[0]
    shape = g.shapes.get(x)
    if shape is None or len(shape) != 4 or shape[3] % 2:
        return None
    half = shape[3] // 2
    for cut, (lo, hi) in zip(cuts, ((0, half), (half, shape[3]))):
        starts, ends, axes = (g.const(cut.input[k]) if len(cut.input) > k else None for k in (1, 2, 3))
        steps = g.const(cut.input[4]) if len(cut.input) > 4 and cut.input[4] else np.ones(1)
        if starts is None or ends is None or axes is None or starts.size != 1 or int(steps.reshape(-1)[0]) != 1:
            return None
        if int(axes.reshape(-1)[0]) not in (-1, 3) or int(starts.reshape(-1)[0]) != lo \
                or min(int(ends.reshape(-1)[0]), shape[3]) != hi:
            return None
    return x, cuts


def _half_table(g, table4):
    """``table4 = Unsqueeze(T, axis 1)`` with ``T = [Mul(]Cos|Sin(Concat(f, f, axis=-1))[, s)]``:
    the same table over ``f`` alone (``[B, T, D/2]``), or None if it is not that."""
    unsqueeze = g.producer.get(table4)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    axes = g.const(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else None
    if axes is None or [int(a) for a in axes.reshape(-1)] != [1]:
        return None
    node, scale = g.producer.get(unsqueeze.input[0]), None
    if node is not None and node.op_type == "Mul":
        consts = [i for i in node.input if scalar(g, i) is not None]
        if len(consts) != 1:
            return None
        scale = consts[0]
        node = g.producer.get(next(i for i in node.input if i != scale))
    if node is None or node.op_type not in ("Cos", "Sin"):
        return None
    cat = g.producer.get(node.input[0])
    if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or cat.input[0] != cat.input[1] \
            or attr(cat, "axis") not in (-1, 2):
        return None
    half = g.fresh(node.op_type.lower() + "_half")
    g.add(node.op_type, [cat.input[0]], [half])
    if scale is not None:
        scaled = g.fresh("scaled")
        g.add("Mul", [half, scale], [scaled])
        half = scaled
    return half


# -- skip norm -------------------------------------------------------------------------

def _skip_norm(g) -> int:
    """``Add(a, b) -> RMS norm`` (the sum also read elsewhere) -> ``SkipSimplifiedLayerNormalization``."""
    count = 0
    for norm in [n for n in g.nodes if ((n.domain or ""), n.op_type) in _RMS]:
        add = g.op(norm.input[0], "Add")
        if add is None or len(norm.input) < 2 or attr(norm, "axis", -1) != -1 or len(norm.output) != 1:
            continue
        shapes = [g.shapes.get(i) for i in add.input]
        if None in shapes or shapes[0] != shapes[1]:
            continue
        g.remove(add, norm)
        eps = attr(norm, "epsilon", 1e-5)
        g.add("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
              [norm.output[0], "", "", add.output[0]], domain=MS, epsilon=eps)
        count += 1
    return count
