"""Rewrites that keep what the device records small in kind and stable from step to step.

* :func:`lift_scalars`: a Python float in arithmetic (``x * 0.9``, ``add_(g, alpha=-lr)``,
  ``addcdiv_(m, v, value=-step_size)``, ``lerp_(g, 0.1)``) becomes a 0-dim tensor input.
  AdamW's bias corrections and a scheduled learning rate change every step; as
  constants they would make every step a new program and a new compile, as inputs
  they are data. Only for floating-point tensors, where a 0-dim float32 (float64 for
  float64) tensor and a Python float promote the same way, except against a 0-dim
  bfloat16/float16 tensor (two 0-dim tensors promote to the wider): that call keeps its
  float. Lifted constants are cached by the float's bits (``-0.0`` is not ``0.0``). For bfloat16 and float16 tensors a lifted scale
  (``alpha``, ``value``, ``lerp``'s weight) keeps the CPU's one rounding: the CPU
  computes those in float32 and rounds the result once, so the lifted form computes in
  float32 too and casts the result back (a scale multiplied in low precision first was a
  second rounding: bf16 ``addcmul_(g, g, value=1e-3)`` and AdamW's ``exp_avg_sq`` were
  1 ulp off). The CPU's scalar loop (a tensor's last elements) rounds ``alpha * other``
  to bf16/f16 first; the device does not (docs/device.md). A float32/float64 ``alpha`` is
  fused as the CPU fuses it: ``addcmul(self, other, alpha)``.
* :func:`lone_in_cat`: a ``cat`` of one tensor and empty ones is recorded as the copy it
  returns (a Hugging Face attention's key concatenated onto an empty cache).
* :func:`functional_form`: the functional operation an in-place one is recorded as
  (``add_`` -> ``add``; batch norm's running-statistics update ->
  ``_native_batch_norm_legit_functional``), with the tensors it updates.
"""
from __future__ import annotations

import struct

import torch

from kiln.device import tensor as dt

aten = torch.ops.aten

_SCALARS: dict = {}

# PLAIN_FORMS: operations whose result PyTorch marks with a key or bit the device's wrapper
# cannot carry, each mapped to the operation that computes the same values plainly.
#
# A complex tensor's ``conj()`` is a view that sets the tensor's conjugate bit, which
# PyTorch's Conjugate key resolves before the next operation reads it; a device tensor's
# wrapper never carried the bit, so ``x.conj()`` on the device was ``x`` itself, silently
# (``x * x.conj()`` gave ``x * x``). The device computes them as new tensors instead: the
# values are right, and a write into ``x.conj()`` does not reach ``x`` (as on a tensor
# after ``resolve_conj()``).
#
# Forward-mode AD makes a zero tangent with ``_efficientzerotensor``: a tensor with the
# ZeroTensor key and no memory, which the device's host tensor cannot be (recording one
# read its storage and failed on autograd's device thread, where PyTorch, unwinding, ended
# the process: ``torch.func.hessian`` and ``jvp`` of ``grad``). The device makes real zeros.
PLAIN_FORMS = {aten._conj.default: aten.conj_physical.default, aten._neg_view.default: aten.neg.default,
               aten._efficientzerotensor.default: aten.zeros.default}


def scalar(value: float, like, ndim=None) -> dt.DeviceTensor:
    """A 0-dim device tensor holding ``value``; the same object for the same value (a
    step's repeated constants are one input, not hundreds). Never written: internal.
    With ``ndim``, a float32 tensor of shape ``(1,) * ndim`` instead: it broadcasts as a
    0-dim tensor does, but promotes a bfloat16/float16 operation of ``ndim`` dimensions or
    fewer to float32 (a 0-dim tensor does not)."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    # by the value's bits: 0.0 == -0.0 (``x * -0.0`` got ``x * 0.0``'s constant) and a NaN
    # equals no NaN (each would be a new entry)
    key = (struct.pack("<d", value), dtype, ndim)
    t = _SCALARS.get(key)
    if t is None:
        if len(_SCALARS) > 4096:           # a schedule's values come and go
            _SCALARS.clear()
        t = _SCALARS[key] = dt.wrap(torch.tensor(value, dtype=dtype).reshape((1,) * (ndim or 0)))
    return t


LOW = (torch.bfloat16, torch.float16)


def low(*tensors):
    """The tensors' dtype when all are bfloat16 (or all float16) tensors: the CPU computes
    their scaled arithmetic in float32 and rounds once; else None."""
    dtype = getattr(tensors[0], "dtype", None)
    return dtype if dtype in LOW and all(getattr(t, "dtype", None) == dtype for t in tensors) else None


def rounded(value: float, dtype) -> float:
    """``value`` as the CPU's add kernel holds an ``alpha`` for ``dtype``'s tensors."""
    return float(torch.tensor(value, dtype=dtype))


def _ndim(*tensors) -> int:
    return max(t.dim() for t in tensors)


def _floating(t) -> bool:
    return isinstance(t, dt.DeviceTensor) and t.dtype.is_floating_point


def may_lift(func, args, kwargs) -> bool:
    """Whether :func:`lift_scalars` may rewrite this call: a lifting rule applies to ``func``
    and a Python float is among its arguments. Cheap, so that a replay does not first
    compare a call whose arguments the rewrite is about to change (it never matches)."""
    if _kind(func) is None:
        return False
    for a in args:
        if type(a) is float:
            return True
    return any(type(v) is float for v in kwargs.values()) if kwargs else False


def lift_scalars(dispatch, func, args, kwargs):
    """``func`` re-dispatched with its Python float arguments as 0-dim tensors, or
    NotImplemented when there is nothing to lift."""
    kind = _kind(func)
    if kind is None or not args or not _floating(args[0]):
        return NotImplemented
    packet = _PACKET.get(id(func)) or _PACKET.setdefault(id(func), getattr(aten, func._schema.name.split("::")[-1]))
    inplace = func._schema.name.endswith("_")
    if kind == "arith":
        other = args[1]
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if not isinstance(other, float) and not isinstance(alpha, float):
            return NotImplemented            # the common case: nothing to lift
        changed = func._overloadname == "Scalar" and isinstance(other, float)
        if isinstance(other, float):
            if args[0].dim() == 0 and args[0].dtype in LOW:
                # a 0-dim float32 tensor promotes a 0-dim bfloat16/float16 one (a Python
                # float does not): the call runs with its float, as on the CPU
                return NotImplemented
            other, changed = scalar(other, args[0]), True
        elif isinstance(alpha, float) and alpha != 1 and _floating(other) and low(args[0], other):
            # the CPU's bf16/f16 add: alpha rounded to the dtype, ``self + alpha * other`` in
            # float32 (the product of two such numbers is exact there), rounded once
            dtype = low(args[0], other)
            scaled = dispatch(aten.mul.Tensor, (other, scalar(rounded(alpha, dtype), args[0], _ndim(args[0], other))), {})
            return _narrowed(dispatch, dispatch(packet.Tensor, (args[0], scaled), {}), dtype, inplace)
        if isinstance(alpha, float) and alpha != 1 and _floating(other):
            # the CPU's float32/float64 add: ``self + alpha * other`` fused, one rounding;
            # addcmul's kernel computes ``self + t1 * t2`` so (a product first was a second
            # rounding: SGD's ``p.add_(g, alpha=-lr)`` 1-2 ulp off)
            like = other if other.dtype == torch.float64 else args[0]
            if func._schema.name.split("::")[-1].rstrip("_") == "sub":
                alpha = -alpha
            fused = aten.addcmul_.default if inplace else aten.addcmul.default
            return dispatch(fused, (args[0], other, scalar(alpha, like)), {})
        if not changed or not isinstance(other, torch.Tensor):
            return NotImplemented
        return dispatch(packet.Tensor, (args[0], other), {} if alpha == 1 else {"alpha": alpha})
    if kind == "addc":
        value = kwargs.get("value", args[3] if len(args) > 3 else 1)
        if not isinstance(value, float) or value == 1:
            return NotImplemented
        dtype = low(*args[:3])
        if dtype is None:
            scaled = dispatch(aten.mul.Tensor, (args[1], scalar(value, args[0])), {})
            return dispatch(packet.default, (args[0], scaled, args[2]), {})
        # the CPU's bf16/f16 addcmul/addcdiv: ``self + value * t1 * t2`` (``/ t2``) in float32,
        # rounded once; the scaled tensor stays float32
        scaled = dispatch(aten.mul.Tensor, (args[1], scalar(value, args[0], _ndim(*args[:3]))), {})
        return _narrowed(dispatch, dispatch(packet.default, (args[0], scaled, args[2]), {}), dtype, inplace)
    if kind == "lerp" and isinstance(args[2], float):
        dtype = low(args[0], args[1])
        if dtype is None:
            return dispatch(packet.Tensor, (args[0], args[1], scalar(args[2], args[0])), {})
        # the CPU's bf16/f16 lerp with a float weight computes in float32 (a weight tensor
        # must have the tensors' dtype: it would be rounded to it)
        wide = [dispatch(aten._to_copy.default, (t,), {"dtype": torch.float32}) for t in args[:2]]
        out = dispatch(aten.lerp.Tensor, (wide[0], wide[1], scalar(args[2], wide[0])), {})
        return dispatch(aten.copy_.default, (args[0], out), {}) if inplace else _narrowed(dispatch, out, dtype, False)
    return NotImplemented


def _narrowed(dispatch, out, dtype, inplace):
    """A float32 result in ``dtype`` again; an in-place call's result already is (its
    tensor's dtype)."""
    return out if inplace else dispatch(aten._to_copy.default, (out,), {"dtype": dtype})


_LIFT_KIND: dict = {}
_PACKET: dict = {}


def _kind(func):
    """:func:`_lift_kind`, worked out once per op (by id: an op's __hash__ is Python code)."""
    kind = _LIFT_KIND.get(id(func), "?")
    if kind == "?":
        kind = _LIFT_KIND[id(func)] = _lift_kind(func)
    return kind


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


def lone_in_cat(args, kwargs):
    """The one non-empty tensor of a ``cat`` whose other tensors are empty, where ``cat``
    returns a contiguous copy of it (same shape and dtype); else None. The device records
    the copy instead (``clone``): Inductor's decomposition of such a ``cat`` clones the
    tensor in its own layout, and a view traced against ``cat``'s contiguous output is then
    refused. A GPT-2 or T5 training step (the key cached as ``cat([empty, k], -2)``,
    transposed and viewed for a batched matmul) ran op by op until 12-03, with Inductor's
    "Cannot view a tensor with shape [2, 4, 8, 16] and strides (512, 8, 1, 32)"; the graphs
    ``torch.compile`` hands kiln get the same rewrite from their metadata
    (:func:`kiln.device.graphs._without_empty_cats`). ``cat``'s own rules decide (on meta
    tensors of the same layouts): an empty tensor of another dtype promotes the result,
    mismatched shapes are ``cat``'s error, a channels-last result stays a ``cat``."""
    tensors = args[0] if args else kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 \
            or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    kept = [t for t in tensors if t.numel() != 0]
    if len(kept) != 1:
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    key = (dim, *((tuple(t.shape), t.stride(), t.dtype) for t in tensors))
    copies = _LONE_CATS.get(key)
    if copies is None:          # cat's rules, worked out once per layout (67 us a call: every step's cache)
        copies = _LONE_CATS[key] = _copies(tensors, kept[0], dim)
    return kept[0] if copies else None


_LONE_CATS: dict = {}


def _copies(tensors, t, dim) -> bool:
    try:
        out = torch.cat([torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                         for x in tensors], dim)
    except (RuntimeError, IndexError, TypeError):
        return False            # cat's own error, raised where it is run
    return out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()


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
