"""Constants kept exact through the ONNX export.

* A float64 graph's Python numbers. ``f + 1e-10`` on a float64 tensor is captured as
  ``aten.add.Tensor(f, 1e-10)``, the number in a Tensor-typed argument. torch's ONNX exporter
  turns such a number into ``aten.scalar_tensor(1e-10, dtype=float64)``, which its
  translation writes as a float32 ``Constant`` cast to double: the number rounded to float32
  first. ``f * 0.1`` came out ``f * 0.10000000149011612`` and the check against eager, at its
  default 1e-3, passed: a silent wrong answer of the default engine for float64 models
  (found by probing, 12-03). :func:`exact_scalars` writes each such number as a float64
  0-dim constant of the partition before the export, a double initializer in the model.
* The exporter's optimizer (onnxscript's rewriter, run for small graphs) removes "no-op"
  arithmetic by a tolerance: ``x + c`` is ``x`` where ``|c| <= 1e-8``, ``x * c`` is ``x`` where
  ``c`` is within a relative 1e-5 of 1. ``x / (x.abs().sum() + 1e-12)`` on a row of zeros came
  out NaN where eager's is 0 (the epsilon removed), and ``x * 1.000001`` came out ``x``
  (found by probing, 12-03). :func:`exact_no_ops` keeps those four rules out of the export;
  an exact ``x + 0`` left in costs an addition.
"""
from __future__ import annotations

import contextlib
import copy

import torch


def exact_scalars(partition) -> torch.fx.GraphModule | None:
    """``partition`` with each Python float given to a Tensor-typed argument of a float64
    node made a float64 constant, in a copy of the graph that shares the weights; None
    where there is none."""
    if not isinstance(partition, torch.fx.GraphModule):
        return None
    todo = [(node, i) for node in partition.graph.nodes for i in _float_tensor_args(node)]
    if not todo:
        return None
    graph = copy.deepcopy(partition.graph)
    local = torch.fx.GraphModule(partition, graph)       # the same weights, a new module
    by_name = {n.name: n for n in graph.nodes}
    for count, (node, i) in enumerate(todo):
        mine = by_name[node.name]
        value = torch.tensor(mine.args[i], dtype=torch.float64)
        name = f"_kiln_float64_scalar_{count}"
        local.register_buffer(name, value)
        with graph.inserting_before(mine):
            constant = graph.get_attr(name)
        fake = getattr(mine.meta.get("val"), "fake_mode", None)
        if fake is not None:
            constant.meta["val"] = fake.from_tensor(value, static_shapes=True)
        args = list(mine.args)
        args[i] = constant
        mine.args = tuple(args)
    local.recompile()
    return local


def _float_tensor_args(node) -> list:
    """Positions of the Python floats ``node`` takes in Tensor-typed arguments, where its
    output is float64."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float64:
        return []
    schema = node.target._schema.arguments
    return [i for i, a in enumerate(node.args)
            if type(a) is float and i < len(schema) and isinstance(schema[i].type, torch.TensorType)]


@contextlib.contextmanager
def exact_no_ops():
    """onnxscript's default rewrite rules without its tolerant arithmetic no-op rules (``x + 0``,
    ``x - 0``, ``x * 1``, ``x / 1`` matched within a tolerance), for the length of an export
    (held under the export's lock). An onnxscript without these names is left as it is."""
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter.rules.common import _no_op
        kept = {id(_no_op.dropout_zero_rule), id(_no_op.dropout_inference_rule)}
        tolerant = {id(r) for r in _no_op.rules} - kept
        original = rewriter._DEFAULT_REWRITE_RULES
    except (ImportError, AttributeError, TypeError):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in original if id(r) not in tolerant)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = original
