"""Operators that take graphs of their own: ``torch.cond``, ``while_loop``, ``map``,
``scan``, FlexAttention's score functions (PyTorch's higher-order operators).

A capture keeps such a node with its branch or body as a submodule of the graph. No
engine kiln drives takes one, and kiln's host program cannot run one either: an artifact
holds operations and tensors, never code to run a subgraph with (loading one must not run
code from it). So a capture that meets one is refused, naming the operator, where it used
to fail later, writing the artifact, with "host constant true_graph_0 is a <lambda>, not
a tensor" (and ``torch.compile(backend="kiln")`` ran such a graph eagerly behind that
message).
"""
from __future__ import annotations

import torch

from kiln.errors import UnsupportedOpError


def refuse(gm: torch.fx.GraphModule, name: str) -> None:
    """Raise :class:`UnsupportedOpError` if a node of ``gm`` takes a graph as an argument: the
    graph is an attribute of ``gm``, read by a ``get_attr`` node that operator uses."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_attribute(gm, node.target), torch.fx.GraphModule):
            for user in node.users:
                op = getattr(user.target, "__name__", None) or str(user.target)
                if op not in found:
                    found.append(op)
    if found:
        who = "the graph" if name.startswith("<") else name      # an FX graph's class: "<lambda>"
        advice = [ADVICE.get(op, ADVICE["default"]) for op in found]
        raise UnsupportedOpError(
            f"{who} uses {', '.join(f'torch.ops.higher_order.{op}' for op in found)}: an operator that "
            "runs graphs of its own, which kiln cannot compile (it compiles straight-line graphs). "
            + " ".join(dict.fromkeys(advice)))


# what to write instead, per operator
ADVICE = {
    "cond": "For torch.cond, compute both branches and pick with torch.where, or compile each branch "
            "as a model of its own and choose in Python.",
    "flex_attention": "For FlexAttention, use torch.nn.functional.scaled_dot_product_attention with its "
                      "score modification as an additive attn_mask.",
    "default": "Write the loop or map as straight-line tensor operations, or compile its body as a model "
               "of its own and loop in Python.",
}


def _attribute(gm, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
