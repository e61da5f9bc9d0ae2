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


def _lifted(values, like, widen=()) -> list:
    """The floats as 0-dim tensors; with ``widen`` (each element's tensors), as float32
    tensors that promote bfloat16/float16 elements to float32 (:func:`kiln.device.rewrites.scalar`)."""
    if not widen:
        return [rewrites.scalar(float(v), t) for v, t in zip(values, like)]
    return [rewrites.scalar(float(v), t, max(x.dim() for x in ts)) for v, t, ts in zip(values, like, widen)]


def _functional(func, name: str, overload: str):
    """The functional op, with the overload that ``overload`` becomes once floats are
    lifted, or None."""
    packet = getattr(aten, name.rstrip("_"), None)
    return getattr(packet, overload, None) if packet is not None else None


def _low(lists) -> bool:
    """Whether each element's tensors are all bfloat16 (or all float16): the CPU computes
    their scaled arithmetic in float32 and rounds once (:func:`kiln.device.rewrites.low`)."""
    return all(rewrites.low(*ts) is not None for ts in zip(*lists))


def _plan(func, name, args, kwargs):
    """``(functional op, args, kwargs, scale, check)`` with floats lifted, or None (split
    instead). ``scale``: ``[(position, tensors, lifted floats)]``, each list multiplied
    first and taking that position of the args (``addcdiv``'s ``value``; for bfloat16 the
    products are float32, as the CPU computes, and the in-place update rounds once).
    ``check``: the in-place call to try on meta, or None for the functional op's."""
    overload = func._overloadname
    selfs = args[0]
    floating = all(t.dtype.is_floating_point for t in selfs)
    if isinstance(kwargs.get("alpha", 1), float) and kwargs.get("alpha") != 1:
        return None
    root = name.strip("_")[len("foreach_"):]
    inplace = name.endswith("_")
    if root in ("addcdiv", "addcmul") and overload in ("Scalar", "ScalarList"):
        value = args[3] if len(args) > 3 else kwargs.get("value", 1)
        values = value if overload == "ScalarList" else [value] * len(selfs)
        if floating and any(isinstance(v, float) for v in values):
            low = _low(args[:3])
            if low and not inplace:
                return None      # per tensor: each result cast back (the in-place update casts)
            widen = list(zip(*args[:3])) if low else ()
            return (_functional(func, name, "Scalar"), (selfs, args[1], args[2]), {},
                    [(1, args[1], _lifted(values, selfs, widen))], None)
        return _functional(func, name, overload), args, kwargs, None, None
    pos = 2 if root == "lerp" else 1
    if overload in ("Scalar", "ScalarList") and floating and len(args) > pos:   # (norm's ord defaults)
        value = args[pos]
        values = value if overload == "ScalarList" else [value] * len(selfs)
        if any(isinstance(v, float) for v in values):
            lifted = list(args)
            if root == "lerp" and _low(args[:2]):
                # the CPU lerps bf16/f16 with a float weight in float32; the weights must have
                # the tensors' dtype, so both lists are widened first (times float32 ones)
                if not inplace:
                    return None
                ones = [_lifted([1.0] * len(selfs), selfs, [(t,) for t in ts]) for ts in args[:2]]
                lifted[pos] = _lifted(values, selfs)
                return (_functional(func, name, "List"), tuple(lifted), kwargs,
                        [(0, selfs, ones[0]), (1, args[1], ones[1])],
                        (getattr(aten, name).Scalar, (selfs, args[1], 0.5), {}))
            lifted[pos] = _lifted(values, selfs)
            return _functional(func, name, "List"), tuple(lifted), kwargs, None, None
    return _functional(func, name, overload), args, kwargs, None, None


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
    functional, fargs, fkwargs, scale, check = plan
    targets = list(args[0]) if inplace else []
    written = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if inplace and written != [0]:
        return NotImplemented
    if _aliased(targets, args if scale is not None else fargs):
        return NotImplemented        # per tensor, in order, as CPU's foreach kernels run
    for t in targets:
        if t._kc.live_base() is not None or t._kc.has_live_views():
            return NotImplemented
    if inplace:
        # the in-place call on meta, floats lifted (their values change every step): the
        # errors eager would raise (a result of a dtype the tensors cannot hold)
        if check is None:
            cargs = list(fargs)
            for pos, tensors, _ in scale or ():
                cargs[pos] = tensors
            check = (getattr(getattr(aten, name), functional._overloadname, None), tuple(cargs), fkwargs)
        try:
            meta_call(*check)
        except Exception:
            return NotImplemented
    if scale is not None:
        fargs = list(fargs)
        for pos, tensors, values in scale:
            scaled = record(aten._foreach_mul.List, (tensors, values), {})
            if scaled is NotImplemented:
                return NotImplemented
            fargs[pos] = scaled
        fargs = tuple(fargs)
    if not inplace:
        return record(functional, fargs, fkwargs)
    if scale is not None and any(t.dtype in rewrites.LOW for t in targets):
        # float32 results (bf16 computed as the CPU does): back to the tensors' dtype in one
        # more call, not one cast per tensor
        wide = record(functional, fargs, fkwargs)
        if wide is NotImplemented:
            return wide
        functional, fargs, fkwargs = aten._foreach_copy.default, (targets, wide), {}
    outs = record_values(functional, fargs, fkwargs)
    if outs is NotImplemented:
        return outs
    for t, (k, sig) in zip(targets, outs):
        rebind(t, k, sig)
    return None
