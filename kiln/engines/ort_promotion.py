"""The ONNX exporter's type-promotion pass, run only where a node needs a cast.

ONNX operators take operands of one type, so before translating, torch's exporter makes
ATen's implicit promotions explicit (``insert_type_promotion_nodes``: a cast before an
``add`` of a float and an int tensor, an int ``div`` computed in float...). It does so by
re-running every node of the graph on fake tensors under the Python dispatcher, whether
or not any node needs a cast; in the graphs kiln exports almost none do (a float model's
nodes already agree on their types). That re-run was 15 % of compiling the tests' tiny
Llama (1.85 of 11.8 s, four graphs, profiled) and 5.8 s of SmolLM2's float32 build.

:func:`needs_promotion` asks the pass's own rules the same question from the types each
node already records (``node.meta["val"]``, written by the capture), without running a
kernel: for every node a rule covers, would any argument be cast? Only where one would
(or where it cannot tell: a value not recorded, an argument of a kind it does not know)
does the exporter's pass run, whole and unchanged; elsewhere the pass would have changed
nothing, so skipping it gives the same graph and the same ONNX bytes.
"""
from __future__ import annotations

import contextlib

import torch

_TABLE: list = []      # the pass's promotion table, built once


def needs_promotion(graph_module) -> bool:
    """Whether the exporter's type-promotion pass would change ``graph_module`` (or could:
    True wherever this cannot tell from the recorded types)."""
    try:
        from torch.onnx._internal.fx import type_utils
        from torch.onnx._internal.fx.passes import type_promotion
    except ImportError:
        return True
    if not _TABLE:
        _TABLE.append(type_promotion.TypePromotionTable())
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return True
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            rule = type_promotion.get_type_promotion_rule(node, _TABLE[0])
            if rule is None:
                continue
            try:
                args = torch.fx.node.map_arg(node.args, _recorded)
                kwargs = torch.fx.node.map_arg(node.kwargs, _recorded)
                info = rule.preview_type_promotion(args, kwargs)
            except _Unrecorded:
                return True
            except Exception:  # noqa: BLE001 - the rule could not judge from types alone: let the pass run
                return True
            if any(_cast(arg, info.args_dtypes.get(i), type_utils) for i, arg in enumerate(node.args)):
                return True
            if any(_cast(arg, info.kwargs_dtypes.get(k), type_utils) for k, arg in node.kwargs.items()):
                return True
    return False


class _Unrecorded(Exception):
    pass


def _recorded(node):
    if "val" not in node.meta:
        raise _Unrecorded
    return node.meta["val"]


def _cast(arg, dtype, type_utils) -> bool:
    """Whether the pass would cast ``arg`` to ``dtype`` (``_maybe_promote_arg``'s cases);
    True for a kind of argument it does not handle (the pass then raises its own error)."""
    if dtype is None:
        return False
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.dtype != dtype
        if type_utils.is_torch_symbolic_type(value):
            return type_utils.from_scalar_type_to_torch_dtype(type(value)) != dtype
        return True
    scalar = type_utils.from_scalar_type_to_torch_dtype(type(arg))
    if scalar is not None:
        return scalar != dtype
    if isinstance(arg, (tuple, list)):
        return any(_cast(a, dtype, type_utils) for a in arg)
    return True


@contextlib.contextmanager
def only_where_needed():
    """For the length of an export: the exporter's type-promotion pass runs on a graph only
    where :func:`needs_promotion` finds a node it would cast."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
    except ImportError:
        yield
        return
    original = getattr(_fx_passes, "insert_type_promotion_nodes", None)
    if original is None:
        yield
        return

    def where_needed(graph_module):
        if needs_promotion(graph_module):
            original(graph_module)

    _fx_passes.insert_type_promotion_nodes = where_needed
    try:
        yield
    finally:
        _fx_passes.insert_type_promotion_nodes = original
