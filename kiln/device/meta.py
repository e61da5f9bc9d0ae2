"""What an operation on device tensors would give, without running it: the operation on
*meta* stand-ins of its arguments (shapes, dtypes and strides only), remembered per
operation and argument signature, so the same step recorded again costs a dictionary
lookup, not a shape computation (:mod:`kiln.device.dispatch` records with it)."""
from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for

from kiln.device import tensor as dt
from kiln.device import trace as tr
from kiln.device import walk

_CACHE: dict = {}
_FUNCS: dict = {}       # id -> operation: each held alive, so its id names it in the cache
_MISSING = object()


def stand_in(a, trace):
    """The meta tensor standing for one argument (a pending device tensor's is its meta in
    ``trace``); raises TypeError for a host tensor the device cannot take as an input."""
    if isinstance(a, dt.DeviceTensor):
        cell = a._kc
        return trace.metas[cell.value] if cell.value is not None else tr.meta_like(cell.data)
    if isinstance(a, torch.Tensor):
        if a.dim() != 0 or a.device.type != "cpu":
            raise TypeError("a host tensor with dimensions")
        return tr.meta_like(a)
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


def signature(a):
    """A hashable stand-in for an argument, as far as output shapes and dtypes go (a
    device tensor's is made with it: its shape, strides and dtype never change)."""
    if type(a) is dt.DeviceTensor:
        return a._ksig
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), type(a) is dt.DeviceTensor)
    if isinstance(a, (list, tuple)):
        return (type(a), tuple([signature(x) for x in a]))
    if isinstance(a, float):
        return (float, a.hex())      # 1.0 is not 1 (nor -0.0 0.0): dtypes differ
    if isinstance(a, int):
        return (type(a), a)          # True is not 1
    return a


def call(func, args, kwargs, trace):
    """``func`` run on meta stand-ins of its arguments; its exception, raised again, when
    it failed (the same call fails the same way next time)."""
    try:
        _FUNCS.setdefault(id(func), func)
        key = (id(func), signature(args),
               tuple([(k, signature(v)) for k, v in kwargs.items()]) if kwargs else ())
        hit = _CACHE.get(key, _MISSING)
    except TypeError:               # an unhashable constant
        key, hit = None, _MISSING
    if hit is not _MISSING:         # None too: an in-place _foreach_ call returns nothing
        if isinstance(hit, Exception):
            raise hit
        return hit

    def of(a):
        return stand_in(a, trace)
    try:
        out = func(*walk.tmap(of, args), **{k: walk.tmap(of, v) for k, v in kwargs.items()})
    except Exception as e:
        if key is not None:
            _CACHE[key] = e
        raise
    if func in _CONVOLUTIONS:
        out = _cpu_conv_layout(func, out, walk.tmap(of, args), kwargs)
    elif func in _EVAL_BATCH_NORMS:
        out = _cpu_layout(out, stand_in(args[0], trace))
        if not _training(func, args, kwargs):
            out = _cpu_statistics(out)
    elif isinstance(out, torch.Tensor) and _dtype_differs(func):
        out = _cpu_dtype(func, out, walk.tmap(of, args), {k: walk.tmap(of, v) for k, v in kwargs.items()})
    if key is not None:
        _CACHE[key] = out
    return out


aten = torch.ops.aten
# Batch norm in eval mode returns its saved statistics as empty tensors on the CPU, and as
# the running statistics' shape ([C]) on any other device, meta included (PyTorch's
# decomposition says so: "very annoying inconsistency where CPU and CUDA give different
# shapes"). The device computes on the CPU, so its outputs are the CPU's: with the meta
# kernel's [C], a BatchNorm model in eval mode with gradients on failed at its first read
# ("a compiled graph returned float32[0] where float32[4] was expected"). Where the CPU's shapes
# follow from the arguments, as here, the metas are corrected and the call is recorded as
# usual; where they depend on the data (EmbeddingBag's), kiln.device.opinfo's _META_DIFFERS
# runs the call at once instead.
_EVAL_BATCH_NORMS = {aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default,
                     aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default}


def _training(func, args, kwargs) -> bool:
    """A batch norm call's ``training`` flag (never set for ``_no_training``, whose sixth
    argument is the momentum)."""
    if func is aten._native_batch_norm_legit_no_training.default:
        return False
    return (args[5] if len(args) > 5 else kwargs.get("training", False)) is True


def _cpu_layout(out, x):
    """A batch norm's output laid out as the CPU's kernel lays it out: contiguous, or
    channels-last where the input ``x`` is (``empty_like(x, x.suggest_memory_format())``),
    where the meta kernel keeps the input's strides. Until 12-03 a transposed input's meta
    strides were recorded, and the common ``transpose -> BatchNorm1d -> transpose -> Linear``
    failed on the real data with "view size is not compatible with input tensor's size and
    stride"."""
    y = out[0]
    layout = torch.contiguous_format
    if not x.is_contiguous():
        for dims, channels_last in ((4, torch.channels_last), (5, torch.channels_last_3d)):
            if x.dim() == dims and x.is_contiguous(memory_format=channels_last):
                layout = channels_last
    want = torch.empty(0, device="meta").new_empty(y.shape, dtype=y.dtype).contiguous(memory_format=layout)
    if want.stride() == y.stride():
        return out
    return (want, *out[1:])


# A convolution's outputs on the CPU are channels-last where its input or its weight is
# (oneDNN's choice; the gradients follow their tensors), and the meta kernel says contiguous:
# until 12-03 a channels-last CNN failed on the device at its first `flatten` ("view size is
# not compatible", the CPU copying where the device recorded a view), and dropout after such a
# convolution drew its mask in another order than the CPU's (found by probing).
_CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}


def _cpu_conv_layout(func, out, metas, kwargs):
    """``out`` laid out as the CPU's kernel lays it out, found by running the call on the CPU
    on zeros of the same strides, one sample of the batch (once per signature: cached). The
    batch is the outermost dimension in every layout the CPU picks, so the sample's strides
    are the whole batch's."""
    tensors = [a for a in metas if isinstance(a, torch.Tensor)]
    if all(t.stride() == tuple(make_contiguous_strides_for(t.shape)) for t in tensors):
        return out          # plain contiguous tensors: the CPU's results are contiguous, as the meta kernel's
    batched = (0,) if func is aten.convolution.default else (0, 1)

    def zeros(i, a):
        if not isinstance(a, torch.Tensor):
            return a
        shape = list(a.shape)
        if i in batched and shape:
            shape[0] = min(shape[0], 1)
        return torch.empty_strided(shape, a.stride(), dtype=a.dtype).zero_()
    try:
        cpu = func(*[zeros(i, a) for i, a in enumerate(metas)], **kwargs)
    except Exception:  # noqa: BLE001 - the CPU's own error comes from the real call, not from here
        return out
    pairs = zip(out, cpu) if isinstance(out, (tuple, list)) else [(out, cpu)]
    fixed = [_strided_as(o, c) if isinstance(o, torch.Tensor) and isinstance(c, torch.Tensor) else o
             for o, c in pairs]
    return type(out)(fixed) if isinstance(out, (tuple, list)) else fixed[0]


def _strided_as(meta, cpu):
    """``meta`` with the strides of the CPU's one-sample result ``cpu``, where they differ."""
    if meta.stride() == cpu.stride() or meta.dim() != cpu.dim() or meta.shape[1:] != cpu.shape[1:] \
            or (meta.dim() and max(cpu.stride(), default=0) != cpu.stride()[0] and cpu.shape[0] > 1):
        return meta
    return torch.empty_strided(meta.shape, cpu.stride(), dtype=meta.dtype, device="meta")


def _cpu_statistics(out):
    """A batch norm's outputs with the saved mean and inverse deviation (outputs 1 and 2)
    empty, as the CPU's kernel makes them in eval mode."""
    out = list(out)
    out[1], out[2] = out[1].new_empty((0,)), out[2].new_empty((0,))
    return tuple(out)


# Operations whose meta kernels give another output dtype than their CPU kernels, by name
# (every overload: pow.Tensor_Scalar, pow.Scalar, ldexp.Tensor, ...): ``pow(bool, True)``
# is bool on the CPU and int64 on meta; ``ldexp(int64, 0-dim float16)`` float16 on the CPU
# and float32 on meta. The device computes on the CPU, and a recorded call with meta's
# dtype failed at its first read ("a compiled graph returned torch.bool[2, 2] where
# torch.int64[2, 2] was expected"). For their functional overloads (an in-place or out=
# one's result is its written tensor's dtype) the dtype is the CPU kernel's on tensors of
# one element with the arguments' dtypes and numbers of dimensions (all promotion reads).
_DTYPE_DIFFERS = {"pow", "ldexp"}
_DIFFERS_OF: dict = {}


def _dtype_differs(func) -> bool:
    hit = _DIFFERS_OF.get(id(func))
    if hit is None:
        schema = func._schema
        hit = _DIFFERS_OF[id(func)] = (func.namespace == "aten" and schema.name.split("::")[-1] in _DTYPE_DIFFERS
                                       and bool(schema.returns) and schema.returns[0].alias_info is None)
    return hit


def _cpu_dtype(func, out, metas, kwargs):
    """``out`` (meta's result) in the dtype the CPU kernel gives for these arguments."""
    def probe(a):
        return torch.ones((1,) * a.dim(), dtype=a.dtype) if isinstance(a, torch.Tensor) else a
    try:
        dtype = func(*walk.tmap(probe, metas), **{k: walk.tmap(probe, v) for k, v in kwargs.items()}).dtype
    except Exception:
        return out
    return out if dtype == out.dtype else out.to(dtype)
