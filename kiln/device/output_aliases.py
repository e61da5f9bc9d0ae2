"""Outputs of a compiled graph that are views of one another, as eager's are.

``def f(x): y = x * 2; return y, y.view(2, -1)``: eager's two outputs share storage, so
writing to one shows in the other. AOTAutograd rebuilds outputs that alias an input, and
outputs aliasing an intermediate where both need gradients, but leaves an inference
graph's (and any output without gradients) to the compiler: Inductor returns views of its
buffers. kiln's compiled programs return a fresh tensor per output, so such outputs came
back as separate tensors (``out[0].fill_(5)`` left ``out[1]`` as it was).

:func:`plan` finds, in the FX graph, the outputs that are views (``view``, ``t``,
``permute``, ``slice``, ``select``, ``expand``, a ``split``'s parts, ...) of one intermediate
value; :func:`rebuild` makes them views of one storage after each run, laid out as the
graph's metadata says eager lays them out. A group needs one output that covers the whole
intermediate (the intermediate itself, or a dense view of all of it): its values fill the
storage (no copy where the compiled output is laid out so already), and the others are
``as_strided`` views of it. A group without such an output (``return y[0], y[1]`` of an
intermediate ``y`` returned nowhere) keeps separate tensors.
"""
from __future__ import annotations

import operator

import torch


def _aliases_input(node) -> bool:
    """Whether ``node`` returns a view of its first argument (a view op, or an element of a
    ``split``'s list of views); in-place ops do not count (functional graphs have none)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    target = node.target
    if target is operator.getitem:
        target = node.args[0].target if node.args[0].op == "call_function" else None
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    returns = [r.alias_info for r in schema.returns]
    return any(a is not None and not a.is_write for a in returns)


def _root(node):
    """The value ``node`` is a view of, following views up (``node`` itself where it is none)."""
    while _aliases_input(node):
        node = node.args[0]
    return node


def _layout(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return (tuple(int(d) for d in val.shape), tuple(int(s) for s in val.stride()),
                int(val.storage_offset()), val.dtype)
    except (TypeError, ValueError):       # symbolic sizes
        return None


def plan(gm: torch.fx.GraphModule) -> list:
    """``[(root layout, cover index, [(index, layout), ...]), ...]``: for each group of
    outputs (indices into the graph's output list) viewing one intermediate, the
    intermediate's layout, the output covering it, and every member's layout."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    groups: dict = {}
    for i, out in enumerate(outputs):
        if isinstance(out, torch.fx.Node):
            groups.setdefault(_root(out), []).append(i)
    found = []
    for root, members in groups.items():
        if len(members) < 2 or root.op == "placeholder":     # views of inputs: AOTAutograd's
            continue
        base = _layout(root)
        layouts = [(i, _layout(outputs[i])) for i in members]
        if base is None or not _covers(base, base) or any(lay is None or lay[3] != base[3] for _, lay in layouts):
            continue
        cover = next((i for i, lay in layouts if _covers(lay, base)), None)
        if cover is not None:
            found.append((base, cover, layouts))
    return found


def _covers(layout, base) -> bool:
    """Whether a view laid out so holds every element of the intermediate ``base``, once."""
    shape, stride, offset, dtype = layout
    numel = 1
    for d in shape:
        numel *= d
    whole = 1
    for d in base[0]:
        whole *= d
    if numel != whole or offset != 0:
        return False
    expected = 1                          # dense: a permutation of a contiguous layout
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True


def rebuild(out: list, groups: list) -> list:
    """``out`` (the compiled graph's outputs, None where it has none) with each group's
    members made views of one storage, as :func:`plan` found them."""
    for (shape, stride, _, dtype), cover, layouts in groups:
        values = out[cover]
        if not isinstance(values, torch.Tensor):
            continue
        cover_layout = dict(layouts)[cover]
        if values.stride() == cover_layout[1] and values.storage_offset() == 0:
            storage = values
        else:
            storage = torch.empty_strided(shape, stride, dtype=dtype, device=values.device)
            storage.as_strided(cover_layout[0], cover_layout[1], 0).copy_(values)
        for i, (size, strides, offset, _) in layouts:
            out[i] = storage.as_strided(size, strides, offset)
    return out
