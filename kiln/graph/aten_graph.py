"""Capture of a graph that is already ATen (a device's step, a ``torch.compile`` graph).

``torch.export`` of such a graph traces it again through the whole export machinery
(functionalization, its module hierarchy, the graph signature) to reach what it nearly is
already: core ATen. A BERT-4L training step (1,418 recorded operations, 2,504 once
decomposed) took 13-20 s of that on 2 cores, the largest part left of its first compile.
The device records functional operations only, and AOTAutograd hands over functional
graphs, so one ``make_fx`` pass over fake tensors with capture's decomposition table gives
the same graph (the same operations, counted one by one on that step) in about a quarter
of the time (22 s against 86 s, measured side by side on a loaded machine).

:func:`traced` takes only what that holds for: a ``GraphModule`` of ATen operator overloads
with no mutating schema, called with tensors, and none that capture keeps whole although
``make_fx`` would decompose it (a composite operator left out of the table:
``scaled_dot_product_attention``, ``KEEP_WHOLE``); anything else (a user's module, an in-place
operation, a Python callable in the graph) returns None and goes through ``torch.export``.
What comes out is checked against eager PyTorch like every capture's compile.
"""
from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree


def traced(model, values: list, decompositions):
    """``model`` (an ATen ``GraphModule``) decomposed with the table ``decompositions()``
    makes, on fake copies of ``values``, in kiln's plain convention (flat tensors in and
    out); None where it does not qualify or the trace fails. The table is made only for a
    graph that qualifies: most captures are of a user's module."""
    if not isinstance(model, torch.fx.GraphModule) or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    ops = set()
    for node in model.graph.nodes:
        if node.op == "call_function":
            if node.target is operator.getitem:
                continue
            if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
                return None
            ops.add(node.target)
        elif node.op not in ("placeholder", "get_attr", "output"):
            return None
    table = decompositions()
    if any(op not in table and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
           for op in ops):
        return None     # make_fx would decompose it; capture keeps it (scaled_dot_product_attention)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fakes = [mode.from_tensor(v) for v in values]
        with torch.no_grad(), mode:
            gm = make_fx(model, decomposition_table=table)(*fakes)
    except Exception:  # noqa: BLE001 - torch.export takes it instead, and explains a failure
        return None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    # flat tensors out: a backward graph's None (no gradient) lives in the output structure
    out.args = (tuple(v for v in pytree.tree_leaves(out.args[0]) if isinstance(v, torch.fx.Node)),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
