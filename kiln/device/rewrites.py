"""Rewrites that keep what the device records small in kind and stable from step to step.

* :func:`foreach`: a ``_foreach_*`` operation (what optimizers and gradient clipping
  use) becomes one operation per tensor, so each is recorded, lifted and run like any
  other.
* :func:`lift_scalars`: a Python float in arithmetic (``x * 0.9``, ``add_(g, alpha=-lr)``,
  ``addcdiv_(m, v, value=-step_size)``, ``lerp_(g, 0.1)``) becomes a 0-dim tensor input.
  AdamW's bias corrections and a scheduled learning rate change every step; as
  constants they would make every step a new program and a new compile, as inputs
  they are data. Only for floating-point tensors, where a 0-dim float32 tensor and a
  Python float promote the same way.
* :func:`functional_form`: the functional operation an in-place one is recorded as
  (``add_`` -> ``add``; batch norm's running-statistics update ->
  ``_native_batch_norm_legit_functional``), with the tensors it updates.
"""
from __future__ import annotations

import torch

from kiln.device import tensor as dt

aten = torch.ops.aten

_ELEMENT_OVERLOADS = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "default"),
                      "ScalarList": ("Scalar", "default"), "Tensor": ("Tensor", "default"),
                      "default": ("default",)}


def _element_op(name: str, overload: str):
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    for candidate in _ELEMENT_OVERLOADS.get(overload, ()):
        op = getattr(packet, candidate, None)
        if op is not None:
            return op
    return None


def foreach(dispatch, run_now, func, name, args, kwargs):
    """``_foreach_<op>(lists...)`` as ``<op>`` per element; run as a whole on the host
    when there is no per-element operation."""
    base = name[len("_foreach_"):]
    lists = [a for a in args if isinstance(a, (list, tuple))]
    if base == "norm":
        element = aten.linalg_vector_norm.default
    else:
        element = _element_op(base, func._overloadname)
    if element is None or not lists:
        return run_now(func, args, kwargs)
    params = element._schema.arguments
    n = len(lists[0])
    results = []
    for i in range(n):
        eargs, ekwargs = [], dict(kwargs)
        for pos, a in enumerate(args):
            value = a[i] if isinstance(a, (list, tuple)) else a
            if pos < len(params) and params[pos].kwarg_only:
                ekwargs[params[pos].name] = value
            else:
                eargs.append(value)
        if base == "norm":
            ekwargs = {"dtype": ekwargs.get("dtype")}
        results.append(dispatch(element, tuple(eargs), ekwargs))
    return None if not func._schema.returns else results


_SCALARS: dict = {}


def _scalar(value: float, like) -> dt.DeviceTensor:
    """A 0-dim device tensor holding ``value``; the same object for the same value (a
    step's repeated constants are one input, not hundreds). Never written: internal."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    key = (value, dtype)
    t = _SCALARS.get(key)
    if t is None:
        if len(_SCALARS) > 4096:           # a schedule's values come and go
            _SCALARS.clear()
        t = _SCALARS[key] = dt.wrap(torch.tensor(value, dtype=dtype))
    return t


def _floating(t) -> bool:
    return isinstance(t, dt.DeviceTensor) and t.dtype.is_floating_point


def lift_scalars(dispatch, func, args, kwargs):
    """``func`` re-dispatched with its Python float arguments as 0-dim tensors, or
    NotImplemented when there is nothing to lift."""
    kind = _LIFT_KIND.get(func, "?")
    if kind == "?":
        kind = _LIFT_KIND[func] = _lift_kind(func)
    if kind is None or not args or not _floating(args[0]):
        return NotImplemented
    packet = getattr(aten, func._schema.name.split("::")[-1])
    if kind == "arith":
        overload = func._overloadname
        other = args[1]
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        changed = overload == "Scalar" and isinstance(other, float)
        if isinstance(other, float):
            other, changed = _scalar(other, args[0]), True
        if isinstance(alpha, float) and alpha != 1 and _floating(other):
            other, alpha, changed = dispatch(aten.mul.Tensor, (other, _scalar(alpha, args[0])), {}), 1, True
        if not changed or not isinstance(other, torch.Tensor):
            return NotImplemented
        return dispatch(packet.Tensor, (args[0], other), {} if alpha == 1 else {"alpha": alpha})
    if kind == "addc":
        value = kwargs.get("value", args[3] if len(args) > 3 else 1)
        if not isinstance(value, float) or value == 1:
            return NotImplemented
        scaled = dispatch(aten.mul.Tensor, (args[1], _scalar(value, args[0])), {})
        return dispatch(packet.default, (args[0], scaled, args[2]), {})
    if kind == "lerp" and isinstance(args[2], float):
        return dispatch(packet.Tensor, (args[0], args[1], _scalar(args[2], args[0])), {})
    return NotImplemented


_LIFT_KIND: dict = {}


def _lift_kind(func):
    """Which lifting rule applies to ``func`` (worked out once per op), or None."""
    if func.namespace != "aten":
        return None
    root, overload = func._schema.name.split("::")[-1].rstrip("_"), func._overloadname
    if root in ("add", "sub", "mul", "div") and overload in ("Tensor", "Scalar"):
        return "arith"
    if root in ("addcdiv", "addcmul") and overload == "default":
        return "addc"
    if root == "lerp" and overload == "Scalar":
        return "lerp"
    return None


def functional_form(func, name, schema, args, kwargs):
    """``(functional op, args, kwargs, updated tensors, returns(args, outs))`` for an
    in-place operation, or None when it has none (it then runs now)."""
    if func is aten.native_batch_norm.default:
        # updates running_mean / running_var in place though its schema does not say so
        if not (len(args) > 5 and args[5] and args[3] is not None and args[4] is not None):
            return func, args, kwargs, [], lambda a, outs: tuple(outs)
        return (aten._native_batch_norm_legit_functional.default, args, kwargs, [args[3], args[4]],
                lambda a, outs: tuple(outs[:3]))
    if func is aten._native_batch_norm_legit.default:
        return (aten._native_batch_norm_legit_functional.default, args, kwargs, [args[3], args[4]],
                lambda a, outs: tuple(outs[:3]))
    functional = _functional_of(func, name, schema)
    if functional is None:
        return None
    return functional, args, kwargs, [args[0]], _first


def _first(args, outs):
    return args[0]


_FUNCTIONAL: dict = {}


def _functional_of(func, name, schema):
    """``add`` for ``add_``: the functional op for an op that writes only its first
    argument, else None (worked out once per op)."""
    if func not in _FUNCTIONAL:
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        found = None
        if written == [0] and name.endswith("_"):
            found = getattr(getattr(aten, name[:-1], None), func._overloadname, None)
        _FUNCTIONAL[func] = found
    return _FUNCTIONAL[func]
