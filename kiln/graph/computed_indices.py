"""Indices a graph computes itself: proven in range when it is compiled, or run where a bad
one raises as in eager.

An index that is a graph *input* is checked at every call before any engine sees it
(:mod:`kiln.graph.index_ranges`). One the graph computes (``ids + 1``, ``argsort`` of one
tensor gathering from a narrower one, ``-1 - i``) cannot be checked there, and the engines
differ on it: eager PyTorch raises ``IndexError``/``RuntimeError``; Inductor's kernels check
it and kiln turns their check into an error (:mod:`kiln.engines.inductor_bounds`);
OpenVINO's ``Gather`` answered a row of zeros for ``index_select(t, 0, ids + 1)`` at the
last id, and ONNX Runtime's ``Gather`` takes ``-size <= i < size``, so a computed -1 read
the last row where ``index_select``, ``gather`` and ``embedding`` raise: silently wrong
answers (12-01).

So, for an engine that does not check (``checks_indices`` false in its contract), and for
``index_copy`` and ``index_add`` on any (Inductor lowers them to an ``index_put``, which
takes a computed -1 from the end: it wrote the last row where eager raises), each
indexing operation's index is bounded by a small interval analysis over the graph, in
exact integers: constants (their values), ``arange``, ``full``, the index outputs of
``argmax``/``sort``/``topk``/``max.dim`` (``0 <= i < size``), integer dtypes' own limits,
``clamp``, a remainder or floor division by a positive number, sums, differences and
products, and anything that only moves values (views, slices, ``cat``, ``where``, a gather
*from* a bounded tensor). An index proven inside the range eager accepts, or one that is a
checked input, stays on the engine; any other runs on the host with eager's kernel
(:func:`kiln.graph.partition.takes`), where a bad value raises eager's own error. A device
graph that would be split by it compiles whole on Inductor instead
(:mod:`kiln.device.graphs`). The positions a model makes for itself (``arange`` sliced,
``cumsum`` of ones) are proven, so common models keep their embeddings on the engine.
"""
from __future__ import annotations

import operator

import torch

from kiln.graph import index_ranges, randomness

aten = torch.ops.aten

WHY_HOST = ("an index the graph computes, which kiln cannot prove in range: OpenVINO answers zeros and "
            "ONNX Runtime reads from the end for an index eager PyTorch rejects, so it runs on the host "
            "with eager's kernel, which raises for a bad one")

# index writes that every compiled engine (Inductor too) makes an ``index_put``, which takes
# a negative index from the end where eager raises: one with an unproven index runs on the
# host even where the engine checks indices. Capture keeps them whole (torch's decompositions
# make them that ``index_put`` too, so a -1 an input held passed its check and wrote the last
# row; kiln.graph.capture.decompositions).
FROM_END_WHEN_COMPILED = {aten.index_copy.default, aten.index_add.default}

# operator -> (argument holding the indexed tensor, argument holding the dim or None for
# dim 0, argument holding the index); eager accepts 0 <= i < size
FROM_ZERO = index_ranges.FROM_ZERO

_DTYPE_LIMITS = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-2 ** 15, 2 ** 15 - 1),
                 torch.int32: (-2 ** 31, 2 ** 31 - 1), torch.int64: (-2 ** 63, 2 ** 63 - 1), torch.bool: (0, 1)}
_SMALL = (torch.uint8, torch.int8, torch.int16, torch.bool)    # whose own limits are worth knowing
_EXACT_FLOAT = 2 ** 53                                         # floats hold integers exactly up to here
_EVALUATED = 4096                # most operations evaluated to find a constant index's values
_MOVES = index_ranges.SAME_VALUES | {
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.repeat.default, aten.flip.default,
    aten.roll.default, aten.contiguous.default, aten.expand_copy.default, aten.view_copy.default,
    aten.permute_copy.default, aten.slice_copy.Tensor, aten.select_copy.int, aten.unsqueeze_copy.default,
    aten.squeeze_copy.dim, aten.clone.default, aten.lift_fresh_copy.default, aten.detach.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
    aten.index_select.default, aten.gather.default, aten.index.Tensor, aten.embedding.default}
# the data argument of the value-moving operators that read from a tensor by index
_DATA = {aten.index_select.default: 0, aten.gather.default: 0, aten.index.Tensor: 0, aten.embedding.default: 0}
_UNIONS = (aten.cat.default, aten.stack.default)
# operators whose output (or output 1) is an index into dim ``dim`` of input 0
_POSITIONS = {aten.argmax.default, aten.argmin.default, aten.sort.default, aten.sort.stable, aten.topk.default,
              aten.max.dim, aten.min.dim, aten.argsort.default, aten.argsort.stable, aten.kthvalue.default,
              aten.mode.default, aten.median.dim}
_LOW, _HIGH = -2 ** 63, 2 ** 63 - 1
# comparisons with a number c -> the range of x where they hold
_COMPARE = {aten.ge.Scalar: lambda c: (c, _HIGH), aten.ge.Tensor: lambda c: (c, _HIGH),
            aten.gt.Scalar: lambda c: (c + 1, _HIGH), aten.gt.Tensor: lambda c: (c + 1, _HIGH),
            aten.lt.Scalar: lambda c: (_LOW, c - 1), aten.lt.Tensor: lambda c: (_LOW, c - 1),
            aten.le.Scalar: lambda c: (_LOW, c), aten.le.Tensor: lambda c: (_LOW, c),
            aten.eq.Scalar: lambda c: (c, c), aten.eq.Tensor: lambda c: (c, c)}
_CONSTANTS = {aten.full.default: 1, aten.full_like.default: 1, aten.scalar_tensor.default: 0,
              aten.new_full.default: 2, aten.fill.Scalar: 1}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
_ONES = {aten.ones.default, aten.ones_like.default, aten.new_ones.default}


def unproven(gm: torch.fx.GraphModule) -> set:
    """The indexing operations of ``gm`` whose index is neither a checked input
    (:func:`kiln.graph.index_ranges.source_of`) nor proven inside eager's range (module doc)."""
    bounds = _Bounds(gm.graph)
    found = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for index, low, high in _indices(node):
            if index_ranges.source_of(index) is not None:
                continue                       # an input: checked at every call
            b = bounds.of(index)
            if b is None or high is None or not (low <= b[0] and b[1] < high):
                found.add(node)
                break
    return found


def indexes(node) -> bool:
    """Whether ``node`` reads a tensor of indices that eager checks."""
    return node.op == "call_function" and (node.target in FROM_ZERO or node.target in index_ranges.FROM_END
                                           or node.target in index_ranges.ADVANCED)


def _indices(node):
    """``(index, low, high)`` for each index ``node`` reads: eager takes ``low <= i < high``
    (``high`` None where the size is not a number)."""
    if node.target in FROM_ZERO or node.target in index_ranges.FROM_END:
        data, dim, index = FROM_ZERO.get(node.target) or index_ranges.FROM_END[node.target]
        if len(node.args) > max(index, dim or 0) and isinstance(node.args[index], torch.fx.Node):
            size = index_ranges.size_of(node.args[data], node.args[dim] if dim is not None else 0)
            yield node.args[index], (0 if node.target in FROM_ZERO or not isinstance(size, int) else -size), size
    elif node.target in index_ranges.ADVANCED and len(node.args) > 1:
        for d, index in enumerate(node.args[1] or ()):
            if isinstance(index, torch.fx.Node) and _dtype(index) is not torch.bool:
                size = index_ranges.size_of(node.args[0], d)
                yield index, (-size if isinstance(size, int) else 0), size


def _dtype(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class _Bounds:
    """Inclusive integer bounds ``(lo, hi)`` of each node's values, or None where unknown;
    each node worked out once."""

    def __init__(self, graph):
        self.known: dict = {}
        self.values: dict = {}                 # node -> its value, where computed from constants
        self.variable = set()                  # nodes that read an input or draw random numbers
        for x in graph.nodes:
            if x.op == "placeholder" or randomness.draws(x) or _mutates(x) \
                    or any(a in self.variable for a in x.all_input_nodes):
                self.variable.add(x)

    def of(self, x):
        if isinstance(x, bool):
            return int(x), int(x)
        if isinstance(x, int):
            return x, x
        if isinstance(x, float):
            return (int(x), int(x)) if x == int(x) else None
        if not isinstance(x, torch.fx.Node):
            return None
        if x not in self.known:
            self.known[x] = None                       # a cycle cannot occur; guards recursion
            b = self._from_constants(x) or self._node(x)
            dtype = _dtype(x)
            limits = _DTYPE_LIMITS.get(dtype, (-_EXACT_FLOAT, _EXACT_FLOAT))
            if b is not None and not limits[0] <= b[0] <= b[1] <= limits[1]:
                b = None                               # wrapped around, or past exact floats
            if b is None and dtype in _SMALL:
                b = limits
            self.known[x] = b
        return self.known[x]

    def assuming(self, mask) -> "_Bounds":
        """Bounds where ``mask`` holds: the values a ``where`` or a product with it keeps.
        Sharded embeddings and losses index with ``(x - start) * mask`` where ``mask`` is
        ``(x >= start) & (x < end)`` (NxD's vocabulary-parallel layers); without this a
        tensor-parallel step's embedding left ONNX Runtime and the whole step built on
        Inductor (17-28 s a graph against 0.1 s)."""
        guard = self._guard(mask)
        if not guard:
            return self
        child = _Bounds.__new__(_Bounds)
        child.values, child.variable = self.values, self.variable
        child.known = {}
        for x, (lo, hi) in guard.items():
            own = self.of(x) or (_LOW, _HIGH)
            child.known[x] = (max(lo, own[0]), min(hi, own[1]))
        return child

    def _guard(self, mask) -> dict:
        """``{node: (lo, hi)}`` that ``mask`` (comparisons of nodes with numbers, joined by
        ``&``, maybe cast to 0/1) implies where it is true; empty where it is no such mask."""
        if not isinstance(mask, torch.fx.Node) or mask.op != "call_function" or not mask.args:
            return {}
        t, a = mask.target, mask.args
        if t is aten._to_copy.default:
            return self._guard(a[0]) if _dtype(a[0]) is torch.bool else {}
        if t in (aten.bitwise_and.Tensor, aten.logical_and.default):
            left, right = self._guard(a[0]), self._guard(a[1])
            if not left or not right:
                return left or right if _dtype(a[0]) is torch.bool and _dtype(a[1]) is torch.bool else {}
            for x, (lo, hi) in right.items():
                old = left.get(x, (lo, hi))
                left[x] = (max(lo, old[0]), min(hi, old[1]))
            return left
        if t not in _COMPARE or len(a) < 2 or not isinstance(a[0], torch.fx.Node):
            return {}
        c = self.of(a[1])
        if c is None or c[0] != c[1]:
            return {}
        low, high = _COMPARE[t](c[0])
        return {a[0]: (low, high)}

    def _from_constants(self, n):
        """``(min, max)`` of an integer tensor the graph computes from constants and shapes
        alone (T5's relative position buckets: ``arange``, ``log``, a cast, ``min``),
        evaluated with PyTorch; None where it reads an input, draws random numbers or is
        more than ``_EVALUATED`` operations."""
        if n in self.variable or _dtype(n) not in _DTYPE_LIMITS or n.op != "call_function":
            return None
        order, seen, todo = [], {n}, [n]
        while todo:
            x = todo.pop()
            if x in self.values:
                continue
            order.append(x)
            if len(order) > _EVALUATED:
                return None
            for a in x.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        where = {x: i for i, x in enumerate(n.graph.nodes)}
        try:
            for x in sorted(order, key=where.__getitem__):
                if x.op == "get_attr":
                    value = operator.attrgetter(x.target)(x.graph.owning_module)
                    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                        return None
                elif x.op == "call_function":
                    args, kwargs = torch.fx.node.map_arg((x.args, x.kwargs), self.values.__getitem__)
                    value = x.target(*args, **kwargs)
                else:
                    return None
                self.values[x] = value
        except Exception:       # noqa: BLE001 - an operation that does not run here proves nothing
            return None
        value = self.values[n]
        if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_floating_point():
            return None
        return int(value.min()), int(value.max())

    def _node(self, n):
        if n.op == "get_attr":
            return _constant(n)
        if n.op != "call_function":
            return None
        t, a = n.target, n.args
        if t is operator.getitem:
            src = a[0]
            if isinstance(src, torch.fx.Node) and src.op == "call_function":
                if src.target in _POSITIONS:
                    return _position(src) if a[1] == 1 else self.of(src.args[0])
                if src.target in _MOVES:
                    return self.of(src.args[0])
            return None
        if t in _POSITIONS:
            return _position(n)
        if t in _DATA:
            return self.of(a[_DATA[t]])
        if t in _MOVES:
            return self.of(a[0]) if a else None
        if t in _UNIONS:
            return _union([self.of(x) for x in a[0]])
        if t in _ZEROS:
            return 0, 0
        if t in _ONES:
            return 1, 1
        if t in _CONSTANTS:
            return self.of(a[_CONSTANTS[t]]) if len(a) > _CONSTANTS[t] else None
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            return _arange(a)
        if t in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
            return _union([self.assuming(a[0]).of(a[1]), self.of(a[2])])
        if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            return _union([self.of(a[0]), self.of(a[2])])
        return self._arithmetic(n)

    def _arithmetic(self, n):
        """Bounds of integer arithmetic: interval rules, exact in Python's integers."""
        t, a = n.target, n.args
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
            alpha = self.of(n.kwargs.get("alpha", 1))
            x, y = self.of(a[0]), self.of(a[1])
            y = _times(y, alpha)
            if x is None or y is None:
                return None
            return (x[0] + y[0], x[1] + y[1]) if t in (aten.add.Tensor, aten.add.Scalar) else \
                (x[0] - y[1], x[1] - y[0])
        if t in (aten.rsub.Scalar, aten.rsub.Tensor):
            x, y = self.of(a[0]), _times(self.of(a[1]), self.of(n.kwargs.get("alpha", 1)))
            return None if x is None or y is None else (y[0] - x[1], y[1] - x[0])
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            for value, mask in ((a[0], a[1]), (a[1], a[0])):
                if self._guard(mask):            # (x - start) * ((x >= start) & (x < end))
                    return _union([self.assuming(mask).of(value), (0, 0)])
            return _times(self.of(a[0]), self.of(a[1]))
        if t is aten.neg.default:
            x = self.of(a[0])
            return None if x is None else (-x[1], -x[0])
        if t is aten.abs.default:
            x = self.of(a[0])
            return None if x is None else ((0 if x[0] <= 0 <= x[1] else min(abs(x[0]), abs(x[1]))),
                                           max(abs(x[0]), abs(x[1])))
        if t in (aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
                 aten.clamp_min.Tensor, aten.clamp_max.Tensor):
            return self._clamp(n)
        if t in (aten.minimum.default, aten.maximum.default):
            x, y = self.of(a[0]), self.of(a[1])
            if x is None or y is None:
                return None
            f = min if t is aten.minimum.default else max
            return f(x[0], y[0]), f(x[1], y[1])
        if t in (aten.remainder.Scalar, aten.remainder.Tensor):
            d = self.of(a[1])
            if d is None or d[0] <= 0:
                return None
            x = self.of(a[0])
            if x is not None and x[0] >= 0 and x[1] < d[0]:
                return x
            return 0, d[1] - 1                      # Python's sign: the divisor's
        if t in (aten.floor_divide.default, aten.div.Tensor_mode, aten.div.Scalar_mode):
            if t is not aten.floor_divide.default and n.kwargs.get("rounding_mode") != "floor":
                return None
            x, d = self.of(a[0]), self.of(a[1])
            if x is None or d is None or d[0] <= 0:
                return None
            return min(x[0] // d[0], x[0] // d[1]), max(x[1] // d[0], x[1] // d[1])
        if t is aten.cumsum.default:
            x = self.of(a[0])
            size = index_ranges.size_of(a[0], a[1])
            if x is None or not isinstance(size, int) or x[0] < 0:
                return None
            return x[0], x[1] * size                 # every prefix holds one element or more
        if _dtype(n) is torch.bool:
            return 0, 1
        return None

    def _clamp(self, n):
        t, a = n.target, n.args
        x = self.of(a[0])
        if x is None:
            x = (-2 ** 63, 2 ** 63 - 1)
        low = high = None
        if t in (aten.clamp.default, aten.clamp.Tensor):
            low = a[1] if len(a) > 1 else n.kwargs.get("min")
            high = a[2] if len(a) > 2 else n.kwargs.get("max")
        elif t in (aten.clamp_min.default, aten.clamp_min.Tensor):
            low = a[1]
        else:
            high = a[1]
        lo_b = self.of(low) if low is not None else None
        hi_b = self.of(high) if high is not None else None
        lo, hi = x
        if lo_b is not None:
            lo, hi = max(lo, lo_b[0]), max(hi, lo_b[0])
        if hi_b is not None:
            lo, hi = min(lo, hi_b[1]), min(hi, hi_b[1])
        if (low is not None and lo_b is None) or (high is not None and hi_b is None):
            return None
        return None if (lo, hi) == (-2 ** 63, 2 ** 63 - 1) else (lo, hi)


def _mutates(node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _union(bounds):
    if not bounds or any(b is None for b in bounds):
        return None
    return min(b[0] for b in bounds), max(b[1] for b in bounds)


def _times(x, y):
    if x is None or y is None:
        return None
    products = [x[0] * y[0], x[0] * y[1], x[1] * y[0], x[1] * y[1]]
    return min(products), max(products)


def _constant(n):
    try:
        value = operator.attrgetter(n.target)(n.graph.owning_module)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.is_floating_point() \
            or value.is_complex() or value.device.type != "cpu":
        return None
    return int(value.min()), int(value.max())


def _arange(a):
    ints = [x for x in a if isinstance(x, int)]
    if len(ints) != len(a):
        return None
    start, end, step = (0, a[0], 1) if len(a) == 1 else (a[0], a[1], a[2] if len(a) > 2 else 1)
    if step == 0:
        return None
    values = range(start, end, step)
    return (min(values[0], values[-1]), max(values[0], values[-1])) if len(values) else None


def _position(n):
    """Bounds of the index output of ``argmax``/``sort``/``topk``/... (``0 <= i < size``)."""
    val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if n.target is aten.topk.default:
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
    elif n.target in (aten.sort.default, aten.argsort.default) and dim is None:
        dim = -1
    elif n.target in (aten.sort.stable, aten.argsort.stable):
        dim = n.kwargs.get("dim", -1)
    elif n.target in (aten.kthvalue.default,):
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
    elif n.target in (aten.mode.default,) and dim is None:
        dim = -1
    if dim is None:                                  # argmax of the flattened tensor
        size = val.numel()
    elif isinstance(dim, int) and -max(val.dim(), 1) <= dim < max(val.dim(), 1):
        size = val.shape[dim] if val.dim() else 1
    else:
        return None
    return (0, int(size) - 1) if isinstance(size, int) and size > 0 else None
