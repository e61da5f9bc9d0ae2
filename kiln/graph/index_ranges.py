"""Integer inputs a model indexes with, and the range eager PyTorch accepts for each.

An index out of range is an error in eager PyTorch (``IndexError: index out of range in
self``), and engines differ on it: ONNX Runtime raises an error of its own, or reads a
negative index from the end where eager rejects it; OpenVINO's ``Gather`` answers zeros (a
token id beyond the vocabulary embedded as a row of zeros: a silently wrong answer); an
AOTInductor kernel's bounds check is turned into an error by
:mod:`kiln.engines.inductor_bounds`. So the compile finds each input that reaches an
indexing operation unchanged (through views, copies, slices and integer casts only) and
records the range that operation accepts; the runtime checks it at every call
(:mod:`kiln.runtime.value_checks`), before any engine sees the values: a min and a max of
the index tensors. An index the graph computes is
:mod:`kiln.graph.computed_indices`' concern.

The ranges are eager's: ``embedding``, ``index_select``, ``gather``, the scatters,
``index_copy``, ``index_add`` and ``index_reduce`` take ``0 <= i < size``; advanced indexing
(``x[i]``, ``index_put``) and ``index_fill`` also take a negative index from the end,
``-size <= i < size``. An input read by several takes all their limits. One read through a
slice, or gathered from (``PART_OF``), is checked whole, a little stricter than eager,
which reads only that part: the position and token-type tables a model slices and gathers
from (BERT's ``position_ids[:, :n]`` and ``token_type_ids.gather(1, position_ids)``, kept
as buffers, a device graph's inputs) hold only good values, and a device graph whose slice of
one went unchecked ran on Inductor alone, 38 s to compile against OpenVINO's 0.9 s
(:mod:`kiln.graph.computed_indices`).
Anything else between the input and the operation (a clamp, a mask, arithmetic) leaves the
input unchecked: its values are not what the operation reads. One mask is read through:
``where(x != k, x, fill)``, which a loss's ``ignore_index`` becomes (``cross_entropy``'s
targets are gathered so): ``x`` must lie in the range or be ``k`` (-100 by default), and
the range entry carries ``k``. Without it, a label beyond the classes ended a process whose
loss ran on Inductor.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

# operator -> (argument holding the indexed tensor, argument holding the dim or None for
# dim 0, argument holding the index): indices from 0
FROM_ZERO = {aten.embedding.default: (0, None, 1), aten.index_select.default: (0, 1, 2),
             aten.gather.default: (0, 1, 2), aten.scatter.src: (0, 1, 2), aten.scatter.value: (0, 1, 2),
             aten.scatter.reduce: (0, 1, 2), aten.scatter.value_reduce: (0, 1, 2),
             aten.scatter_add.default: (0, 1, 2), aten.scatter_reduce.two: (0, 1, 2),
             aten.index_copy.default: (0, 1, 2), aten.index_add.default: (0, 1, 2),
             aten.index_reduce.default: (0, 1, 2)}
# the same, where eager also takes a negative index from the end
FROM_END = {aten.index_fill.int_Scalar: (0, 1, 2), aten.index_fill.int_Tensor: (0, 1, 2)}
# advanced indexing: a list of optional indices, one per leading dim; negatives from the end
ADVANCED = (aten.index.Tensor, aten.index_put.default)
# operators whose output holds exactly its input's values
SAME_VALUES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
                aten.permute.default, aten.clone.default, aten.alias.default, aten.t.default,
                aten.transpose.int, aten._to_copy.default}
# operators whose output holds part of their first argument's values (gathered from it):
# that argument is checked whole
PART_OF = {aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.slice_copy.Tensor, aten.select_copy.int,
           aten.gather.default, aten.index_select.default, aten.index.Tensor, aten.embedding.default}


def input_ranges(gm: torch.fx.GraphModule) -> dict:
    """``{placeholder position: (low, high, operator, exempt)}``: the input at that position
    must lie in ``low <= i < high`` for ``operator``, or equal ``exempt`` where that is not
    None (module doc)."""
    positions = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    ranges: dict = {}

    def limit(index, low, high, what):
        source, exempt = _source(index)
        if source not in positions or not isinstance(high, int):
            return
        i = positions[source]
        old = ranges.get(i)
        ranges[i] = (low, high, what, exempt) if old is None else (
            max(old[0], low), min(old[1], high), old[2], old[3] if old[3] == exempt else None)

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in FROM_ZERO or node.target in FROM_END:
            data, dim, index = FROM_ZERO.get(node.target) or FROM_END[node.target]
            if len(node.args) > max(index, dim or 0):
                size = size_of(node.args[data], node.args[dim] if dim is not None else 0)
                if isinstance(size, int):
                    limit(node.args[index], 0 if node.target in FROM_ZERO else -size, size,
                          str(node.target.overloadpacket.__name__))
        elif node.target in ADVANCED and len(node.args) > 1:
            for d, index in enumerate(node.args[1] or ()):
                size = size_of(node.args[0], d)
                if index is not None and isinstance(size, int):
                    limit(index, -size, size, "indexing")
    return ranges


def source_of(node):
    """The integer input whose values ``node`` holds unchanged (but where masked, see
    :func:`_source`): one the runtime checks at every call; None if none."""
    return _source(node)[0]


def _source(node):
    """``(placeholder, exempt)``: the input whose values ``node`` holds unchanged, but where
    it equals ``exempt`` (a masked ``ignore_index``, else None); ``(None, None)`` if none."""
    exempt = None
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in SAME_VALUES or node.target in PART_OF:
            if node.target is aten._to_copy.default and not (_integer(node) and _integer(node.args[0])):
                return None, None
            node = node.args[0]
        elif exempt is None and (k := _masked(node)) is not None:
            exempt, node = k, node.args[1]
        else:
            break
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder" and _integer(node)):
        return None, None
    return node, exempt


def _masked(node):
    """``k`` where ``node`` is ``where(x != k, x, fill)`` with a constant ``fill`` (an
    ``ignore_index`` masked out before a gather), else None."""
    if node.target is not aten.where.self or len(node.args) != 3:
        return None
    cond, x, fill = node.args
    if not (isinstance(cond, torch.fx.Node) and cond.op == "call_function" and cond.target is aten.ne.Scalar
            and cond.args[0] is x and isinstance(cond.args[1], int)):
        return None
    constant = isinstance(fill, (int, float)) or (isinstance(fill, torch.fx.Node) and fill.op == "call_function"
                                                  and fill.target is aten.scalar_tensor.default)
    return cond.args[1] if constant else None


def _integer(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in _INTEGER


def size_of(node, dim):
    """``node``'s size along ``dim`` where it is a number, else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or not -val.dim() <= dim < max(val.dim(), 1):
        return None
    size = val.shape[dim] if val.dim() else 1
    return size if isinstance(size, int) else None


def of_inputs(gm: torch.fx.GraphModule, input_specs: list) -> dict:
    """``{input position: [low, high, operator]}`` for the captured graph ``gm`` (before
    partitioning); empty where the graph's inputs are not the specs' (nothing is checked
    rather than the wrong input)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if len(vals) != len(input_specs) or not all(
            isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(s.shape) and v.dtype == s.dtype
            for v, s in zip(vals, input_specs)):
        return {}
    return {i: [low, high, what] + ([exempt] if exempt is not None else [])
            for i, (low, high, what, exempt) in input_ranges(gm).items() if low < high}


def recorded(captured) -> list:
    """The input tensor specs' dicts for a manifest, an input with a range holding it as
    ``"range": [low, high, operator]``."""
    dicts = [s.to_dict() for s in captured.input_specs]
    for i, r in (captured.index_ranges or {}).items():
        dicts[i]["range"] = list(r)
    return dicts
