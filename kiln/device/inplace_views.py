"""In-place changes of a device tensor's shape or strides: ``x.transpose_(0, 1)``, ``t_``,
``squeeze_``, ``unsqueeze_``, ``as_strided_``.

Why: ATen's own modules use them (``nn.GRU`` and ``nn.RNN`` with ``batch_first=True``
transpose their output in place), so refusing them refused those modules on the device.

How: a wrapper subclass's shape lives in its own TensorImpl, which PyTorch changes the way
:func:`torch.utils._python_dispatch.return_and_correct_aliasing` does, by running the
operation's meta kernel on the wrapper itself. The tensor's value becomes the out-of-place
view (``transpose``) of what it held, recorded like any view of a whole-tensor alias of its
old self; the tensor keeps that alias alive, so aliases made before (``y = x.detach()``)
keep the old shape and share memory with it, as on the CPU.

Still refused, with the error saying what to use: operations that change the storage, not
only the view of it (``resize_``, ``set_``), and a tensor with live views (they would be
re-derived from a base whose shape changed under them).
"""
from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from kiln.device import tensor as dt

aten = torch.ops.aten

# in-place changes of a tensor's shape or strides, by operator name
NAMES = {"resize_", "resize_as_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_",
         "as_strided_", "swapdims_", "swapaxes_", "_resize_output_"}
# in-place operator -> the view it makes in place
_VIEW_OF = {aten.transpose_.default: aten.transpose.int, aten.swapdims_.default: aten.transpose.int,
            aten.swapaxes_.default: aten.transpose.int, aten.t_.default: aten.t.default,
            aten.squeeze_.default: aten.squeeze.default, aten.squeeze_.dim: aten.squeeze.dim,
            aten.squeeze_.dims: aten.squeeze.dims, aten.unsqueeze_.default: aten.unsqueeze.default,
            aten.as_strided_.default: aten.as_strided.default}


def _on_wrapper(op, *args):
    """``op`` run on a wrapper tensor's own metadata, as its meta kernel would (module doc)."""
    with no_dispatch():
        include = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            op(*args)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(include)


def conform(t):
    """``t`` with its shape, strides and offset made its host data's, where an operation run
    on the host data resized it: an ``out=`` kernel does (``torch.arange(4, device=...)``
    fills an empty tensor it resizes, and its shape read ``(0,)``). Returns ``t``."""
    data = t._kc.data if isinstance(t, dt.DeviceTensor) else None
    if not isinstance(data, torch.Tensor):
        return t
    sig = dt.signature(data)
    if sig == t._ksig:
        return t
    # set_ onto the wrapper's own (data-less) storage: as_strided_ would check its bytes
    _on_wrapper(aten.set_.source_Storage_storage_offset, t, torch.Tensor.untyped_storage(t),
                data.storage_offset(), data.shape, data.stride())
    t._ksig = dt.signature(t)
    if t._ksig != sig:
        raise AssertionError(f"kiln device: a tensor's metadata {t._ksig} could not follow its data's {sig}")
    return t


def apply(dispatch, func, args, kwargs):
    """``args[0]`` given ``func``'s new shape in place and the matching view as its value;
    returns it. ``dispatch`` records the out-of-place view."""
    self = args[0]
    view = _VIEW_OF.get(func)
    if view is None or not isinstance(self, dt.DeviceTensor):
        raise RuntimeError(f"kiln device: {func} changes a tensor's storage in place, which kiln's "
                           "device tensors do not support; make a new tensor instead (torch.empty, cat)")
    if self._kc.has_live_views():
        raise RuntimeError(f"kiln device: {func} would change the shape of a tensor that has views, "
                           "which kiln's device does not support; use the out-of-place form "
                           f"({view.__name__.split('.')[0]})")
    old = dt.alias(self, self)                 # the old shape, over the same cell
    new = dispatch(view, (old,) + tuple(args[1:]), kwargs)
    _on_wrapper(lambda: func(*args, **kwargs))      # the wrapper's own sizes and strides
    if dt.signature(self) != new._ksig:
        raise AssertionError(f"kiln device: {func} gave {dt.signature(self)}, its view {new._ksig}")
    self._kc, self._ksig, self._kold = new._kc, new._ksig, old
    return self
