"""Replaying a recorded step instead of recording it again.

A training step records the same operations every time: the same ATen calls, on
tensors of the same shapes, wired the same way, with the same constants. Recording one
from scratch means computing its output's shape on meta tensors (cached), building the
program's key text and an operation record: about 20 µs of Python an operation. So a
trace starts with a *template*, the trace that followed the same predecessor last time
(:func:`kiln.device.trace.follow`; in lazy mode, the previous step), and each call is
compared with the template's next operation:

* the **guard** of a call is a flat list built from its arguments (:func:`walk`): for
  each tensor its value index in the trace (an earlier operation's output, or an input
  numbered in order of first use, as the program's key numbers them) and its dtype,
  shape, strides and offset; for a 0-dim host tensor the same; for every other
  argument its type and value (floats by ``float.hex``, so ``-0.0`` is not ``0.0`` and
  ``1`` is not ``1.0`` or ``True``); for lists and tuples their type and length; for
  keyword arguments their names.
* the call **replays** when its operation is the template's next one and the guards are
  equal: the template's operation record and output metas are reused, no meta tensor
  is run, no key text built. Equal guards mean equal recordings: the output shapes are
  a function of the operation and the signatures, and the key of the program is a
  function of the operations, the wiring, the constants and the inputs' signatures.
* any difference (another operation, another shape, a different scalar, another wiring,
  a branch the template did not take) ends the replay for the rest of the trace: that
  call and everything after it are recorded afresh, and the key is the template's text
  up to there followed by the new operations'. The fresh trace is then the template for
  the next time. A replay never runs a program other than the one recording would
  have produced; it only skips the work of finding that out twice.

:func:`kiln.device.dispatch.dispatch` replays a whole call (no rewrites, no checks) when
the template recorded it as a plain functional operation or a view; calls that record
through rewrites (lifted scalars, in-place updates, ``_foreach_*``, dropout) go through
the dispatcher as before and replay at the recording itself.
"""
from __future__ import annotations

import torch

from kiln.device import tensor as dt
from kiln.device import trace as tr

_CPU = torch.device("cpu")


def walk(trace, args, kwargs):
    """``(args, kwargs, guard, fresh)``: the arguments as the program reads them
    (:class:`~kiln.device.trace.Ref` for tensors), the call's guard, and the host tensors
    it reads that are not yet inputs of ``trace`` (a dict, id -> (order, tensor), as
    :meth:`~kiln.device.trace.Trace.index_of` builds it; registered only if the call is
    recorded). Raises TypeError for a host tensor with dimensions (the device does not
    take one as an input: the call runs now)."""
    guard, fresh = [], {}
    gargs = _walk(trace, args, guard, fresh)
    gkwargs = {}
    if kwargs:
        for name, v in kwargs.items():
            guard.append(name)
            gkwargs[name] = _walk(trace, v, guard, fresh)
    return gargs, gkwargs, guard, fresh


def guard(trace, args, kwargs):
    """``(guard, fresh)`` of :func:`walk`, without the arguments: all a replay needs."""
    guard, fresh = [], {}
    _walk(trace, args, guard, fresh, False)
    if kwargs:
        for name, v in kwargs.items():
            guard.append(name)
            _walk(trace, v, guard, fresh, False)
    return guard, fresh


def matches(trace, guard, args, kwargs):
    """The host tensors the call reads that are not yet inputs of ``trace`` (``fresh``, as
    :func:`walk` gives them) when the call's guard equals ``guard``, else None: the guard
    compared as it is walked, with no list built and the walk stopped at the first
    difference (a replayed operation's cost is mostly this comparison). Element for
    element the test ``guard == walk(...)[2]`` makes."""
    fresh = {}
    try:
        i = _match(trace, args, guard, 0, fresh)
        if i >= 0 and kwargs:
            for name, v in kwargs.items():
                if i >= len(guard) or guard[i] != name:
                    return None
                i = _match(trace, v, guard, i + 1, fresh)
                if i < 0:
                    return None
    except TypeError:            # a host tensor with dimensions: the call runs now
        return None
    return fresh if i == len(guard) else None


def _same(g, v) -> bool:
    return g is v or g == v      # a list's comparison: identity first, as for NaN


def _match(trace, a, guard, i, fresh) -> int:
    """:func:`_walk` of ``a`` compared with ``guard`` from position ``i``: the position after
    it, or -1 at the first difference."""
    if isinstance(a, dt.DeviceTensor):
        if i + 2 > len(guard):
            return -1
        cell = a._kc
        k = cell.value
        if k is None:
            k = trace.index_of(cell.data, fresh)
        return i + 2 if _same(guard[i], k) and _same(guard[i + 1], a._ksig) else -1
    if isinstance(a, torch.Tensor):
        if a.dim() != 0 or a.device.type != "cpu":
            raise TypeError("a host tensor with dimensions")
        if i + 2 > len(guard):
            return -1
        data = a.detach().clone()
        k = trace.index_of(data, fresh)
        return i + 2 if _same(guard[i], k) and _same(guard[i + 1], (data.dtype, False)) else -1
    cls = type(a)
    if i >= len(guard) or not _same(guard[i], cls):
        return -1
    i += 1
    if isinstance(a, (list, tuple)):
        if i >= len(guard) or not _same(guard[i], len(a)):
            return -1
        return _match_items(trace, a, guard, i + 1, fresh)
    if i >= len(guard):
        return -1
    if isinstance(a, float):
        return i + 1 if guard[i] == a.hex() else -1
    return i + 1 if _same(guard[i], a) else -1


def _match_items(trace, items, guard, i, fresh) -> int:
    """:func:`_match` of each item in turn, the common ones (device tensors, ints, None)
    without a call of their own: an operation's arguments are mostly these."""
    n = len(guard)
    for x in items:
        t = type(x)
        if t is dt.DeviceTensor:
            if i + 2 > n:
                return -1
            cell = x._kc
            k = cell.value
            if k is None:
                k = trace.index_of(cell.data, fresh)
            g, sig = guard[i], guard[i + 1]
            if not (g is k or g == k) or not (sig is x._ksig or sig == x._ksig):
                return -1
            i += 2
        elif t is int or t is bool or x is None:
            if i + 2 > n or guard[i] is not t or not (guard[i + 1] is x or guard[i + 1] == x):
                return -1
            i += 2
        else:
            i = _match(trace, x, guard, i, fresh)
            if i < 0:
                return -1
    return i


def _walk(trace, a, guard, fresh, refs=True):
    if isinstance(a, dt.DeviceTensor):
        cell = a._kc
        k = cell.value
        if k is None:
            k = trace.index_of(cell.data, fresh)
        guard.append(k)
        guard.append(a._ksig)
        return tr.Ref(k) if refs else None
    if isinstance(a, torch.Tensor):
        if a.dim() != 0 or a.device.type != "cpu":
            raise TypeError("a host tensor with dimensions")
        data = a.detach().clone()         # an optimizer's step count: copied in as an input
        k = trace.index_of(data, fresh)
        guard.append(k)
        guard.append((data.dtype, False))
        return tr.Ref(k) if refs else None
    cls = type(a)
    guard.append(cls)
    if isinstance(a, (list, tuple)):
        guard.append(len(a))
        items = [_walk(trace, x, guard, fresh, refs) for x in a]
        return items if cls is list else tuple(items)
    if isinstance(a, float):
        guard.append(a.hex())
        return a
    guard.append(a)
    if cls is torch.device and a.type == dt.device_type():
        return _CPU
    return a


def next_op(trace, func, guard):
    """The template's next operation when ``func`` with ``guard`` is it, else that of
    another recent trace with the same operations so far (:meth:`Trace.switch`), else
    None."""
    template = trace.template
    n = len(trace.ops)
    if n < len(template.ops):
        op = template.ops[n]
        if op.func is func and op.guard == guard:
            return op
    return trace.switch(func, guard)
