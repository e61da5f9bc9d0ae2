"""``_foreach_*`` operations (what optimizers and gradient clipping run) on the device.

An optimizer step over a model's parameters is a handful of ``_foreach_*`` calls, each
over every parameter. Recording each call as **one** operation of the trace, not one
per tensor, is what makes recording an optimizer step cheap: a dispatch of Python per
call, not per parameter (an AdamW step of a 4-layer BERT: 8 calls, not 730). kiln
registers its tensors as foreach-capable with PyTorch's optimizers
(:func:`kiln.device.registration.register`), which then take their foreach path.

* :func:`record_whole` records a call whole. In-place calls are recorded as their
  functional form (``_foreach_mul_`` -> ``_foreach_mul``) and each updated tensor is
  rebound to its result. Python floats (a learning rate, AdamW's per-parameter bias
  corrections: they change every step) become 0-dim tensor inputs, as
  :func:`kiln.device.rewrites.lift_scalars` does for single tensors, so a new value is
  new data, not a new program.
* :func:`element_call` is one element of a call: the operation on tensor ``i``. A
  program's graph (:meth:`kiln.device.trace.Trace.graph`) expands each recorded call
  into its elements, so engines see ordinary operations; interpreting runs the call
  as it is.
* :func:`split` is the fallback: the call dispatched element by element (a call mixing
  host tensors in, a float ``alpha``, an operation with no functional form).
"""
from __future__ import annotations

import torch

from kiln.device import rewrites
from kiln.device import tensor as dt

aten = torch.ops.aten

_ELEMENT_OVERLOADS = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "default"),
                      "ScalarList": ("Scalar", "default"), "Tensor": ("Tensor", "default"),
                      "default": ("default",)}
_ELEMENT: dict = {}


def is_foreach(func) -> bool:
    return func.__name__.startswith("_foreach_")


def element_op(func):
    """The per-tensor operation of a ``_foreach_*`` overload, or None (worked out once)."""
    if func not in _ELEMENT:
        base = func._schema.name.split("::")[-1][len("_foreach_"):]
        found = aten.linalg_vector_norm.default if base == "norm" else None
        packet = getattr(aten, base, None)
        if base.rstrip("_") in ("addcdiv", "addcmul") and func._overloadname == "Tensor":
            packet = None        # one 1-D tensor of per-tensor scalars: no per-tensor form
        if packet is not None and found is None:
            # the overload taking one element of each list, by the arguments' types: the
            # names do not say (``_foreach_pow.Scalar`` is ``pow.Tensor_Scalar``; ``pow.Scalar``
            # is a number raised to a tensor)
            wanted = [_element_type(a) for a in func._schema.arguments]
            names = list(_ELEMENT_OVERLOADS.get(func._overloadname, ()))
            names += [n for n in packet.overloads() if n not in names and not n.endswith("out")]
            found = next((getattr(packet, n) for n in names
                          if hasattr(packet, n) and _takes(getattr(packet, n), wanted)), None)
        _ELEMENT[func] = found
    return _ELEMENT[func]


def _element_type(argument) -> str:
    t = str(argument.type)
    return t[len("List["):-1] if t.startswith("List[") else t


def _takes(op, wanted: list) -> bool:
    """Whether ``op``'s arguments are ``wanted``'s types in order (further ones defaulted)."""
    params = op._schema.arguments
    return len(params) >= len(wanted) and all(str(p.type) == t for p, t in zip(params, wanted)) \
        and all(p.has_default_value() for p in params[len(wanted):])


def element_call(func, args, kwargs, i):
    """``(op, args, kwargs)``: what ``func(*args, **kwargs)`` does to tensor ``i``."""
    element = element_op(func)
    params = element._schema.arguments
    eargs, ekwargs = [], dict(kwargs)
    for pos, a in enumerate(args):
        value = a[i] if isinstance(a, (list, tuple)) else a
        if pos < len(params) and params[pos].kwarg_only:
            ekwargs[params[pos].name] = value
        else:
            eargs.append(value)
    if element is aten.linalg_vector_norm.default:
        ekwargs = {"dtype": ekwargs.get("dtype")}
    return element, tuple(eargs), ekwargs


def split(dispatch, run_now, func, args, kwargs):
    """The call as one dispatch per tensor; run as a whole on the host when there is no
    per-tensor operation."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    if element_op(func) is None or not lists:
        return run_now(func, args, kwargs)
    results = [dispatch(*element_call(func, args, kwargs, i)) for i in range(len(lists[0]))]
    return None if not func._schema.returns else results


def _device_lists(args) -> bool:
    """Whether every tensor in the call's lists is a device tensor (a list of scalars
    is not a tensor list)."""
    tensors = [a for a in args if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a)]
    return bool(tensors) and tensors[0] is args[0] and all(
        isinstance(t, dt.DeviceTensor) for a in tensors for t in a)


def _lifted(values, like) -> list:
    return [rewrites.scalar(float(v), t) for v, t in zip(values, like)]


def _functional(func, name: str, overload: str):
    """The functional op, with the overload that ``overload`` becomes once floats are
    lifted, or None."""
    packet = getattr(aten, name.rstrip("_"), None)
    return getattr(packet, overload, None) if packet is not None else None


def _plan(func, name, args, kwargs):
    """``(functional op, args, kwargs, scale)`` with floats lifted, or None (split
    instead). ``scale``: ``(tensors, lifted floats)`` to multiply first, the scaled
    tensors then taking the place of ``args[1]`` (``addcdiv``'s ``value``)."""
    overload = func._overloadname
    selfs = args[0]
    floating = all(t.dtype.is_floating_point for t in selfs)
    if isinstance(kwargs.get("alpha", 1), float) and kwargs.get("alpha") != 1:
        return None
    root = name.strip("_")[len("foreach_"):]
    if root in ("addcdiv", "addcmul") and overload in ("Scalar", "ScalarList"):
        value = args[3] if len(args) > 3 else kwargs.get("value", 1)
        values = value if overload == "ScalarList" else [value] * len(selfs)
        if floating and any(isinstance(v, float) for v in values):
            return _functional(func, name, "Scalar"), (selfs, None, args[2]), {}, (args[1], _lifted(values, selfs))
        return _functional(func, name, overload), args, kwargs, None
    pos = 2 if root == "lerp" else 1
    if overload in ("Scalar", "ScalarList") and floating and len(args) > pos:   # (norm's ord defaults)
        value = args[pos]
        values = value if overload == "ScalarList" else [value] * len(selfs)
        if any(isinstance(v, float) for v in values):
            lifted = list(args)
            lifted[pos] = _lifted(values, selfs)
            return _functional(func, name, "List"), tuple(lifted), kwargs, None
    return _functional(func, name, overload), args, kwargs, None


def _aliased(targets, args) -> bool:
    """Whether recording the call whole could differ from running it tensor by tensor:
    a tensor updated twice, or an updated tensor read at another position of another
    list (it would be read after its update there, before it here)."""
    index = {id(t._kc): i for i, t in enumerate(targets)}
    if len(index) != len(targets):
        return True
    for a in args[1:]:
        if isinstance(a, (list, tuple)):
            for j, t in enumerate(a):
                i = index.get(id(getattr(t, "_kc", None)))
                if i is not None and i != j:
                    return True
    return False


def record_whole(record, record_values, meta_call, rebind, func, name, args, kwargs):
    """Record a ``_foreach_*`` call as one operation; NotImplemented when it cannot be
    (the caller then splits it). ``record``, ``record_values`` (the outputs as value
    indices and signatures, no tensors), ``meta_call`` and ``rebind(tensor, value,
    signature)`` (point a tensor at a new pending value, in its dtype) are the
    dispatcher's."""
    if not _device_lists(args):
        return NotImplemented
    inplace = name.endswith("_")
    plan = _plan(func, name, args, kwargs)
    if plan is None or plan[0] is None or element_op(plan[0]) is None:
        return NotImplemented
    functional, fargs, fkwargs, scale = plan
    targets = list(args[0]) if inplace else []
    written = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if inplace and written != [0]:
        return NotImplemented
    if _aliased(targets, fargs if scale is None else (fargs[0], scale[0], fargs[2])):
        return NotImplemented        # per tensor, in order, as CPU's foreach kernels run
    for t in targets:
        if t._kc.live_base() is not None or t._kc.has_live_views():
            return NotImplemented
    if inplace:
        # the in-place call on meta, floats lifted (their values change every step): the
        # errors eager would raise (a result of a dtype the tensors cannot hold)
        check = getattr(getattr(aten, name), functional._overloadname, None)
        cargs = fargs if scale is None else (fargs[0], scale[0], fargs[2])
        try:
            meta_call(check, cargs, fkwargs)
        except Exception:
            return NotImplemented
    if scale is not None:
        scaled = record(aten._foreach_mul.List, scale, {})
        if scaled is NotImplemented:
            return NotImplemented
        fargs = (fargs[0], scaled, fargs[2])
    if not inplace:
        return record(functional, fargs, fkwargs)
    outs = record_values(functional, fargs, fkwargs)
    if outs is NotImplemented:
        return outs
    for t, (k, sig) in zip(targets, outs):
        rebind(t, k, sig)
    return None
