"""The partition as OpenVINO's PyTorch (FX) frontend should read it.

The frontend converts most of core ATen as capture leaves it, but not all of it, and a few
ops it converts give other answers than torch's. Each fix is made on a copy of the
partition's graph (the partition itself is built by other engines too; copies share its
weights), node by node, and the build is checked against eager like any other:

* ``aten.reshape`` is spelled ``aten.view``, which the frontend knows (OpenVINO's tensors
  have no strides, so the two are the same Reshape).
* Whole ``scaled_dot_product_attention`` becomes OpenVINO's fused op, wrong with
  grouped-query heads and NaN on fully masked rows (:func:`prepared`).
* ``native_layer_norm`` converts only where its normalized output alone is read; a training
  step reads its mean and reciprocal deviation too (for the backward), and the frontend
  failed on them ("Index: 1 is out of bounds of input list of len: 1"): such a node gets
  torch's decomposition (``var_mean``, ``rsqrt`` ...).
* Ops whose converter reads arguments capture left at their defaults get them spelled out.

Decompositions are traced one node at a time (:func:`decompose`). A re-trace of the whole
partition (``make_fx`` with the core-ATen table) took about two thirds of each of SmolLM2's
30-layer OpenVINO builds, to change 30 nodes out of some 2,500.
"""
from __future__ import annotations

import copy
import operator

import torch

from kiln.engines.ov_dtypes import may_be_negative


def prepared(partition):
    """The partition as OpenVINO's FX frontend should read it; the partition itself is
    not changed (other engines build from it): copies share its weights.

    Capture keeps ``scaled_dot_product_attention`` whole, and the views of its output as
    reshapes (:data:`kiln.graph.capture.KEEP_WHOLE`). OpenVINO converts whole SDPA to its
    fused ScaledDotProductAttention (all-MiniLM-L6-v2: 20.2 against 20.6 ms decomposed)
    but two of its answers differ from torch's:

    * with grouped-query heads (keys and values repeated by ``expand``, Hugging Face's
      ``repeat_kv``) it is wrong: a Llama decoder step's logits were off by 0.12, exact
      with the heads unrepeated. Such a partition gets torch's own decomposition of SDPA,
      re-traced here (what OpenVINO ran before attention was kept whole);
    * a row whose every key is masked gives NaN (a softmax over nothing but -inf) where
      torch gives zeros: those rows, read off the mask, are set to zero after it.

    The other fixes are the module docstring's.
    """
    aten = torch.ops.aten
    nodes = list(partition.graph.nodes)
    repeated = any(is_sdpa(n) and repeated_heads(n) for n in nodes)
    statistics = any(_norm_statistics_read(n) for n in nodes)
    if not repeated and not statistics and not any(
            n.target is aten.reshape.default or n.target in _SPELLED_OUT or (is_sdpa(n) and _sdpa_mask(n) is not None)
            or _negative_indices(n) for n in nodes):
        return partition
    graph = copy.deepcopy(partition.graph)
    for node in list(graph.nodes):
        if node.target is aten.reshape.default:
            node.target = aten.view.default
        elif node.target in _SPELLED_OUT:
            node.args = _with_defaults(node)
        elif is_sdpa(node) and _sdpa_mask(node) is not None and not repeated:
            _zero_fully_masked_rows(graph, node)
        elif _negative_indices(node):
            _counted_from_the_start(graph, node)
    if repeated or statistics:       # torch's decompositions, node by node (decompose)
        return decompose(partition, graph, lambda n: (repeated and is_sdpa(n)) or _norm_statistics_read(n))
    return torch.fx.GraphModule(partition, graph)


# ops whose converter reads arguments capture leaves at their defaults (``vector_norm(x, 2.0)``,
# a gradient clip's: "num_inputs >= min_inputs" failed): they get them spelled out
_SPELLED_OUT = {torch.ops.aten.linalg_vector_norm.default}


def _with_defaults(node) -> tuple:
    """``node``'s positional arguments, those it leaves at their defaults written out."""
    schema = [a for a in node.target._schema.arguments if not a.kwarg_only]
    return tuple(node.args) + tuple(a.default_value for a in schema[len(node.args):])


def _norm_statistics_read(node) -> bool:
    """A ``native_layer_norm`` whose mean or reciprocal deviation is read (a training step's
    forward keeps them for the backward): OpenVINO's frontend converts its first output only."""
    return node.op == "call_function" and node.target is torch.ops.aten.native_layer_norm.default and any(
        user.target is not operator.getitem or user.args[1] != 0 for user in node.users)


def is_sdpa(node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_mask(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


_SHAPE_ONLY = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.clone.default,
               torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default,
               torch.ops.aten.slice.Tensor, torch.ops.aten.contiguous.default}


def repeated_heads(sdpa) -> bool:
    """Whether SDPA's key or value reaches it through an ``expand`` (repeated heads)."""
    for value in sdpa.args[1:3]:
        while isinstance(value, torch.fx.Node) and value.op == "call_function":
            if value.target is torch.ops.aten.expand.default:
                return True
            if value.target not in _SHAPE_ONLY:
                break
            value = value.args[0]
    return False


def _zero_fully_masked_rows(graph, sdpa):
    """out = where(row has a key to attend to, sdpa(...), 0), the row read off the mask."""
    aten = torch.ops.aten
    mask = _sdpa_mask(sdpa)
    with graph.inserting_after(sdpa):
        if mask.meta["val"].dtype == torch.bool:
            valid = graph.call_function(aten.any.dim, (mask, -1, True))
        else:
            peak = graph.call_function(aten.amax.default, (mask, [-1], True))
            valid = graph.call_function(aten.gt.Scalar, (peak, float("-inf")))
    with graph.inserting_after(valid):
        zero = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": sdpa.meta["val"].dtype})
    with graph.inserting_after(zero):
        out = graph.call_function(aten.where.self, (valid, sdpa, zero))
    sdpa.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)


_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor}


def _negative_indices(node) -> list:
    """``(dimension, index)`` for each index tensor of an indexing with several of them that
    may be negative. OpenVINO read ``p[i, j]`` with a negative ``j`` from the previous row
    (``tab[1, -1]`` gave ``tab[0, 3]``; one index tensor with negatives is right), found by
    probing 12-03."""
    if node.op != "call_function" or node.target not in _INDEXING or len(node.args) < 2:
        return []
    indices = list(node.args[1])
    if sum(i is not None for i in indices) < 2:
        return []
    return [(d, i) for d, i in enumerate(indices) if isinstance(i, torch.fx.Node) and may_be_negative(i)]


def _counted_from_the_start(graph, node):
    """Each index tensor that may be negative written as PyTorch reads it: ``where(i < 0, i + n, i)``."""
    aten = torch.ops.aten
    sizes = node.args[0].meta["val"].shape
    indices = list(node.args[1])
    for d, index in _negative_indices(node):
        with graph.inserting_before(node):
            negative = graph.call_function(aten.lt.Scalar, (index, 0))
            wrapped = graph.call_function(aten.add.Tensor, (index, int(sizes[d])))
            indices[d] = graph.call_function(aten.where.self, (negative, wrapped, index))
    node.args = (node.args[0], indices, *node.args[2:])


def decompose(gm: torch.fx.GraphModule, graph: torch.fx.Graph, chosen) -> torch.fx.GraphModule:
    """A GraphModule of ``graph`` (a copy of ``gm``'s graph, sharing its weights) where each
    node ``chosen(node)`` picks is replaced by its core-ATen decomposition (a node with
    several outputs: each ``getitem`` of it by the matching output)."""
    from torch._decomp import core_aten_decompositions, get_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    table = {**core_aten_decompositions(), **get_decompositions([torch.ops.aten.native_layer_norm.default])}
    constants: dict = {}
    traced: dict = {}        # nodes alike (every layer's attention) share one trace
    for node in [n for n in graph.nodes if n.op == "call_function" and chosen(n)]:
        inputs = [a for a in node.all_input_nodes]
        key = (node.target, tuple((tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in inputs),
               repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: inputs.index(a))))
        if key not in traced:
            examples = [torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype) for a in inputs]

            def call(*values, node=node, inputs=inputs):
                env = dict(zip(inputs, values))
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
                return node.target(*args, **kwargs)

            with torch.no_grad():
                traced[key] = make_fx(call, decomposition_table=table)(*examples)
        sub = traced[key]
        env = {}
        placeholders = iter(inputs)
        with graph.inserting_before(node):
            for s in sub.graph.nodes:
                if s.op == "placeholder":
                    env[s] = next(placeholders)
                elif s.op == "get_attr":
                    name = f"_kiln_decomposed_{len(traced)}_{s.target}"
                    constants[name] = getattr(sub, s.target)
                    env[s] = graph.get_attr(name)
                    env[s].meta.update(s.meta)
                elif s.op == "output":
                    result = torch.fx.node.map_arg(s.args[0], lambda a: env[a])
                else:
                    env[s] = graph.node_copy(s, lambda a: env[a])
        if isinstance(result, (tuple, list)):
            for user in list(node.users):           # only getitems read a multi-output node
                assert user.target is operator.getitem, user
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
    graph.lint()
    attributes = {n.target: constants[n.target] if n.target in constants else _attribute(gm, n.target)
                  for n in graph.nodes if n.op == "get_attr"}
    return torch.fx.GraphModule(attributes, graph)


def _attribute(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module
