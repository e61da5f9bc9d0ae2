"""Exact rewrites of an exported ONNX graph that ONNX Runtime's own optimiser misses.

A decoder's token step is a long chain of small ops, and at one token per row the cost
of each op is mostly its dispatch: SmolLM2-135M's int4 decode step was 2,160 nodes, of
which 211 did the weight products and the rest cost ~2 us each. These rewrites remove
nodes without changing the arithmetic:

* ``linear``: core ATen spells a linear layer on a 3-D activation as ``view`` to 2-D,
  ``mm``, ``view`` back; exported as ``Reshape → MatMul → Reshape``. ``MatMul`` with a 2-D
  right-hand side (and ``MatMulNBits`` after weight-only quantization) takes the 3-D
  activation itself, so both reshapes go.
* ``transpose``: the exporter writes ``x @ W.T`` as ``MatMul(x, Transpose(W))`` with the
  weight a constant; the transposed weight is stored instead (what ORT's constant folding
  would do at session time), so quantizers see a constant weight without ORT's
  pre-processing pass.
* ``rms_norm``: transformers' RMSNorm (Llama, Mistral, Qwen2, ...) is written out as
  ``x * rsqrt(mean(x**2) + eps) * weight``, exported as seven ops that ORT's
  ``SimplifiedLayerNormalization`` fusion does not recognise (it expects ``Div``, the
  exporter writes ``Reciprocal``). It becomes one ``SimplifiedLayerNormalization`` (ORT did
  not go on to fold the residual add into it on SmolLM2's graph).

torch's exporter has an optimizer (onnxscript's rewriter) that does both, and more; but its
cost grows faster than the graph (42 s of a 65 s compile for SmolLM2's 30-layer decode
step), so kiln skips it on large partitions
(:data:`kiln.engines.onnx_model.EXPORTER_OPTIMIZE_MAX_OPS`) and runs these instead, in
about a second. Measured on that int4 decode step (2 cores, ONNX Runtime alone, five
alternating runs): 2,160 → 1,462 nodes, 11.2 → 10.6 ms.

Every rewrite matches only when the shapes (the exporter's ``value_info``) prove it exact
and no removed value is used elsewhere; what matched is counted for the blob's header. The
compiled graph is still checked against eager PyTorch, as every partition is.
"""
from __future__ import annotations

import collections


def rewrite(model) -> dict:
    """Apply the rewrites to ``model`` (an ``onnx.ModelProto``) in place; counts by name."""
    counts = {"transpose": _weight_transposes(model.graph), "linear": _linear(model.graph),
              "rms_norm": _rms_norm(model.graph)}
    return {k: v for k, v in counts.items() if v}


class GraphIndex:
    """Producers, consumers, shapes and constants of a graph, and node removal (also what
    :mod:`kiln.engines.ort_fusions` indexes its graph with). ``shapes``: value name ->
    static shape when the caller has inferred them, else those the graph records."""

    def __init__(self, graph, shapes=None):
        from onnx import numpy_helper
        self.graph = graph
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers = collections.defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self.shapes = {} if shapes is None else shapes
        for v in [] if shapes is not None else list(graph.input) + list(graph.value_info) + list(graph.output):
            dims = v.type.tensor_type.shape.dim
            if dims and all(d.HasField("dim_value") for d in dims):
                self.shapes[v.name] = [d.dim_value for d in dims]
        self.initializers = {i.name: i for i in graph.initializer}
        self._consts = {}
        self._numpy = numpy_helper.to_array
        for n in graph.node:
            if n.op_type == "Constant" and n.attribute:
                self._consts[n.output[0]] = n.attribute[0]

    def const(self, name):
        """The value of a constant input (an initializer, a Constant node, or a Reshape of
        constants, as the unoptimised exporter writes a reduction's axes), else None."""
        if name in self.initializers:
            return self._numpy(self.initializers[name])
        if name in self._consts:
            return _constant(self._consts[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Reshape":
            value, shape = self.const(node.input[0]), self.const(node.input[1])
            if value is not None and shape is not None and value.size == abs(int(shape.prod())):
                return value.reshape([int(d) for d in shape])
        return None

    def only_use(self, value, node) -> bool:
        """``value`` feeds ``node`` alone and is not a graph output."""
        users = self.consumers.get(value, [])
        return value not in self.outputs and len(users) == 1 and users[0] is node

    def remove(self, nodes):
        ids = {id(n) for n in nodes}
        keep = [n for n in self.graph.node if id(n) not in ids]
        del self.graph.node[:]
        self.graph.node.extend(keep)


def _constant(attribute):
    """A Constant node's value, whichever of its attributes holds it (None for sparse)."""
    import numpy as np
    from onnx import helper, numpy_helper
    value = helper.get_attribute_value(attribute)
    if attribute.name == "value":
        return numpy_helper.to_array(value)
    if attribute.name in ("value_int", "value_ints", "value_float", "value_floats"):
        return np.array(value)
    return None


def _weight_transposes(graph) -> int:
    """``Transpose(initializer)`` → the transposed initializer, under the node's output name.

    A weight that feeds only its transpose (every linear layer's) is rewritten where it lies:
    appending a transposed copy, then rebuilding the initializer list without the original,
    copied each message twice more (protobuf copies on append and extend), 1.8 of 3 graphs'
    5.5 s for SmolLM2's float32 build."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    g = GraphIndex(graph)
    inputs = {i.name for i in graph.input}
    # types whose raw bytes are the NumPy array's (not bfloat16, not packed 4-bit)
    plain = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.INT8,
             TensorProto.UINT8, TensorProto.INT32, TensorProto.INT64}
    dead, appended = [], False
    for n in graph.node:
        if n.op_type != "Transpose" or n.input[0] not in g.initializers or n.output[0] in g.outputs:
            continue
        init = g.initializers[n.input[0]]
        perm = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "perm"), None)
        value = np.transpose(numpy_helper.to_array(init), perm)     # a view; tobytes is C order
        if (g.only_use(n.input[0], n) and init.name not in inputs and init.data_type in plain
                and init.HasField("raw_data") and init.data_location != TensorProto.EXTERNAL):
            init.name = n.output[0]
            del init.dims[:]
            init.dims.extend(value.shape)
            init.raw_data = value.tobytes()
        else:
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), n.output[0]))
            appended = True
        dead.append(n)
    g.remove(dead)
    if appended:        # an original another node still read stays; one nothing reads goes
        used = {i for n in graph.node for i in n.input} | g.outputs
        for k in reversed([k for k, i in enumerate(graph.initializer) if i.name not in used]):
            del graph.initializer[k]
    return len(dead)


def _linear(graph) -> int:
    """``Reshape(x→2-D) → MatMul(·, W) → Reshape(→ x's leading dims + [N])`` → ``MatMul(x, W)``.

    One flattened activation often feeds several products (query, key and value; gate and
    up): it goes when every one of its users is such a product."""
    g = GraphIndex(graph)
    dead, count = [], 0
    for flat in list(graph.node):
        if flat.op_type != "Reshape" or flat.output[0] in g.outputs:
            continue
        x_shape, flat_shape = g.shapes.get(flat.input[0]), g.shapes.get(flat.output[0])
        if not (x_shape and flat_shape) or len(x_shape) < 3 or flat_shape != [_prod(x_shape[:-1]), x_shape[-1]]:
            continue
        products = [_product_and_back(g, n, x_shape) for n in g.consumers.get(flat.output[0], [])]
        if not products or any(p is None for p in products):
            continue
        for n, back in products:
            n.input[0] = flat.input[0]
            n.output[0] = back.output[0]
            dead.append(back)
        dead.append(flat)
        count += len(products)
    g.remove(dead)
    return count


def _product_and_back(g: GraphIndex, n, x_shape):
    """(n, the Reshape after it) when ``n`` is a constant-weight product whose result is
    only reshaped back to ``x_shape``'s leading dims."""
    # any 2-D right-hand side (a weight, often ``Transpose(weight)`` before ORT folds it)
    if n.op_type not in ("MatMul", "MatMulNBits") or n.input[0] == n.input[1]:
        return None
    if n.op_type == "MatMul" and len(g.shapes.get(n.input[1], ())) != 2:
        return None
    users = g.consumers.get(n.output[0], [])
    if n.output[0] in g.outputs or len(users) != 1 or users[0].op_type != "Reshape":
        return None
    out_shape = g.shapes.get(users[0].output[0])
    if not out_shape or out_shape[:-1] != x_shape[:-1]:
        return None
    return n, users[0]


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _rms_norm(graph) -> int:
    """``Mul(W, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps)))))`` →
    ``SimplifiedLayerNormalization(x, W, axis=-1, epsilon=eps)``."""
    from onnx import helper
    g = GraphIndex(graph)
    dead, added = [], []
    for scale in list(graph.node):
        match = _match_rms(g, scale)
        if match is None:
            continue
        x, weight, eps, chain = match
        dead += chain
        added.append((scale, helper.make_node("SimplifiedLayerNormalization", [x, weight], list(scale.output),
                                              name=scale.name + "/kiln_rms_norm", axis=-1, epsilon=eps)))
    for scale, fused in added:
        index = list(graph.node).index(scale)
        graph.node.insert(index, fused)
    g.remove(dead)
    return len(added)


def _match_rms(g: GraphIndex, scale):
    """(x, weight, eps, the nodes the fused op replaces) when ``scale`` ends an RMSNorm."""
    if scale.op_type != "Mul":
        return None
    for w_in, norm_in in ((0, 1), (1, 0)):
        weight, norm = scale.input[w_in], g.producer.get(scale.input[norm_in])
        w = g.const(weight)
        if w is None or w.ndim != 1 or norm is None or norm.op_type != "Mul":
            continue
        for x_in in (0, 1):
            x, recip = norm.input[x_in], g.producer.get(norm.input[1 - x_in])
            chain = _rsqrt_mean_square(g, x, recip)
            if chain is None or g.shapes.get(x, [None])[-1] != w.shape[0]:
                continue
            eps, nodes = chain
            if not g.only_use(norm.output[0], scale) or not all(
                    g.only_use(a.output[0], b) for a, b in zip(nodes, nodes[1:] + [norm])):
                continue
            return x, weight, eps, nodes + [norm, scale]
    return None


def _rsqrt_mean_square(g: GraphIndex, x, recip):
    """(eps, [Pow, ReduceMean, Add, Sqrt, Reciprocal]) when ``recip`` is
    ``1 / sqrt(mean(x ** 2, last axis, keepdims) + eps)``."""
    chain = []
    node = recip
    for op in ("Reciprocal", "Sqrt", "Add", "ReduceMean", "Pow"):
        if node is None or node.op_type != op:
            return None
        chain.append(node)
        node = g.producer.get(node.input[0])
    recip, sqrt, add, mean, power = chain
    rank = len(g.shapes.get(x, []))
    eps, two = g.const(add.input[1]), g.const(power.input[1])
    axes = g.const(mean.input[1]) if len(mean.input) > 1 else None
    keepdims = next((a.i for a in mean.attribute if a.name == "keepdims"), 1)
    if power.input[0] != x or two is None or two.size != 1 or float(two.reshape(())) != 2.0:
        return None
    if eps is None or eps.size != 1 or axes is None or axes.size != 1 or keepdims != 1:
        return None
    if int(axes.reshape(())) not in (-1, rank - 1):
        return None
    return float(eps.reshape(())), chain[::-1]


def replace_nodes(model, nodes: list, microsoft: bool = False):
    """Make ``nodes`` the main graph's nodes and drop the initializers nothing reads any more
    (the weights a rewrite replaced); ``microsoft``: the new nodes include ONNX Runtime's
    contrib operators (``MatMulNBits``), so the model imports the ``com.microsoft`` domain.
    Shared by the weight-only rewrites (:mod:`~kiln.engines.ort_int4`,
    :mod:`~kiln.engines.ort_blocks`, :mod:`~kiln.engines.ort_merge`)."""
    from onnx import helper
    graph = model.graph
    del graph.node[:]
    graph.node.extend(nodes)
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    drop_unread_initializers(graph, read)
    if microsoft and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def drop_unread_initializers(graph, read: set):
    """Delete the initializers whose names are not in ``read``, in place. Clearing the list
    and adding back those kept copied every kept weight: 0.42 s for 265 MB here, against
    0.4 ms in place, and SmolLM2's weight-only rewrites did it three times per graph."""
    inits = graph.initializer
    for k in range(len(inits) - 1, -1, -1):
        if inits[k].name not in read:
            del inits[k]
