"""The tensor of kiln's device: a PyTorch wrapper subclass on the ``kiln`` (PrivateUse1)
device whose data lives in host memory.

A :class:`DeviceTensor` points at a :class:`Cell`, which holds its value in one of two
states:

* **concrete**: ``data`` is an ordinary CPU tensor with the same shape and dtype; CPU
  kernels read and write it in place, with no copy.
* **pending**: ``value`` is a value index in the current
  :class:`~kiln.device.trace.Trace` (an operation recorded, not yet run). Reading it
  (``item()``, ``print``, ``cpu()``) flushes the trace.

Aliases that are the whole tensor (``detach``, ``.data``, ``alias``) share one cell, so
an in-place update through either is seen by both with nothing to copy. Other views
(slices, transposes, reshapes) get a cell of their own that remembers its base and how
it was made (``base``); the base's cell knows its live views (``views``). After a flush
a view is re-derived from its base's data, so the two share memory as views must, and
mutating a view (or a tensor with views) runs at once on that shared memory instead of
being recorded (see :mod:`kiln.device.dispatch`).

Every operation on these tensors arrives at ``__torch_dispatch__`` (below autograd, so
backward passes arrive too) and goes to :func:`kiln.device.dispatch.dispatch`.
"""
from __future__ import annotations

import copy
import warnings
import weakref

import torch

_DEVICE = ["kiln"]     # the PrivateUse1 name: "kiln", or "neuron" (KILN_DEVICE_NAME)
_TORCH_DEVICE = [None]  # torch.device(_DEVICE[0], 0), made once the name is registered
# kiln.device.dispatch's dispatch and materialize, installed by that module when it loads
# (it imports this one, so this one cannot import it)
_HANDLERS: dict = {}


def set_handlers(dispatch, materialize):
    _HANDLERS["dispatch"], _HANDLERS["materialize"] = dispatch, materialize


class BackwardFailure:
    """What an operation that failed in a backward pass returns instead of raising.

    Why: autograd runs a device's backward operations on its own thread, under a stream
    guard whose destructor (PyTorch 2.13, a Python backend's guard) calls into Python. An
    exception raised here leaves Python's error pending while the C++ stack unwinds, that
    call fails inside a ``noexcept`` destructor, and the process ends (``terminate called
    without an active exception``) instead of ``backward()`` raising. Returned in place of
    the tensor, this object makes PyTorch raise a C++ error naming it (its ``str`` is the
    original error), with no Python error pending: the backward pass stops and the caller
    gets a RuntimeError that says what failed."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self):
        return self.text

    __repr__ = __str__

    @classmethod
    def of(cls, func, error: Exception):
        failure = cls(f"[kiln's device failed to run {func} in a backward pass: {type(error).__name__}: "
                      f"{error}; the backward pass stopped and no gradient was written by this operation]")
        returns = len(func._schema.returns) if hasattr(func, "_schema") else 1
        if returns == 0:            # PyTorch's error for an operation returning nothing names no text
            warnings.warn(failure.text, RuntimeWarning, stacklevel=2)
        return failure if returns == 1 else (failure,) * max(returns, 1)


def device_type() -> str:
    return _DEVICE[0]


def set_device_type(name: str):
    _DEVICE[0] = name
    _TORCH_DEVICE[0] = None


class Cell:
    """What a device tensor (and its whole-tensor aliases) holds."""
    __slots__ = ("data", "value", "base", "views", "__weakref__")

    def __init__(self, data=None, value=None):
        self.data = data          # a CPU tensor, or None while pending
        self.value = value        # value index in the current trace while pending
        self.base = None          # (weakref to the base DeviceTensor, op, args after the base,
        #                            kwargs, output index) for views
        self.views = None         # weak set of the cells of live views of this one

    def has_live_views(self) -> bool:
        return bool(self.views) and any(True for _ in self.views)

    def live_base(self):
        """The base tensor of this view while it lives, else None: a view whose base is
        gone (a backward pass's temporary, typically) aliases nothing anyone can see,
        and is from then on a tensor of its own."""
        if self.base is None:
            return None
        base = self.base[0]()
        if base is None:
            self.base = None
        return base


class DeviceTensor(torch.Tensor):
    """A tensor on kiln's device; see the module docstring."""

    @staticmethod
    def __new__(cls, like, cell=None, requires_grad=True):
        # no __init__: every operation makes one of these, and a Python __init__ costs
        if not isinstance(cell, Cell):
            # ``type(param)(data, requires_grad=...)`` (accelerate's set_module_tensor_to_device):
            # a device Parameter's type is this class, and the CPU's answer is a Parameter
            return torch.nn.Parameter(like, requires_grad=requires_grad if cell is None else cell)
        return made(signature(like), cell)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return _HANDLERS["dispatch"](func, args, kwargs or {})
        except Exception as error:
            if torch._C._current_graph_task_id() < 0:       # not in a backward pass
                raise
            return BackwardFailure.of(func, error)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):
        """``param.data = other``: this tensor takes ``other``'s shape and cell (its data
        or pending value), as a CPU tensor takes the other's storage."""
        if not isinstance(new, DeviceTensor):
            raise TypeError(f"cannot assign a tensor on {new.device} to .data of a tensor on "
                            f"{self.device}; move it first: .to('{_DEVICE[0]}')")
        torch.Tensor.data.__set__(self, new)
        self._kc, self._ksig = new._kc, new._ksig

    def host(self) -> torch.Tensor:
        """The concrete CPU tensor (shared memory, not a copy), flushing pending work first."""
        if self._kc.data is None:
            _HANDLERS["materialize"]()
        data = self._kc.data
        if not isinstance(data, torch.Tensor):     # promised by a program in flight
            data = self._kc.data = data.get()
        return data

    def __repr__(self, *, tensor_contents=None):
        text = repr(self.host())
        grad = f", grad_fn=<{type(self.grad_fn).__name__}>" if self.grad_fn is not None else ""
        body = text[:-1] if text.endswith(")") else text
        body = body.split(", grad_fn=")[0].split(", requires_grad=")[0]
        return f"{body}, device='{self.device}'{grad})"

    __str__ = __repr__

    def numpy(self, *, force=False):
        """A copy's NumPy array, read-only: the data is in host memory already, so reading
        works where CUDA's and torch_xla's tensors raise TypeError (``.cpu()`` first). A
        copy, so the device tensor is not changed behind the trace's back; read-only, so a
        write into it (``t.numpy()[0] = 1``, which changes a CPU tensor) is NumPy's
        ValueError, not a change silently lost. ``force=True`` gives a writable copy, and is
        needed for a tensor that requires grad (the CPU's error otherwise)."""
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        array = self.host().detach().clone().numpy()
        if not force:
            array.flags.writeable = False
        return array

    def untyped_storage(self):
        """The storage of the host memory holding the values (flushing pending work first).
        A wrapper tensor's own storage has no data, and libraries read storages to find
        tensors that share memory (``save_pretrained`` and safetensors: "Attempted to access
        the data pointer on an invalid python storage"); device tensors that share memory
        share this storage too."""
        return self.host().untyped_storage()

    def data_ptr(self) -> int:
        """The address of the first element in the host memory holding the values (flushing
        pending work first), as a CPU tensor's: a tensor and its views share memory and
        their pointers say so; a clone's differs. A wrapper tensor's own pointer is only its
        byte offset, so ``ones(2)`` and ``zeros(5)`` both said 0 and code that finds
        aliases by ``data_ptr`` (``x.clone().data_ptr() == x.data_ptr()``) was wrong. Like
        ``untyped_storage``, it is the memory of the value now: lazy mode gives an updated
        tensor new memory at a flush, so a pointer kept across steps may change."""
        return self.host().data_ptr()

    def tolist(self):
        """The values as (nested) Python numbers, read from host memory: PyTorch's own
        ``tolist`` refuses tensor subclasses, and ``loss.tolist()`` is a common line."""
        return self.host().tolist()

    def __copy__(self):
        """``copy.copy``: a new tensor sharing this one's memory, as on the CPU (where it is
        rebuilt from the same storage). It went through ``__reduce_ex__`` below and came
        back a CPU tensor."""
        alias = self.detach()
        return alias.requires_grad_() if self.requires_grad else alias

    def __deepcopy__(self, memo):
        """A clone with its own cell, as ``copy.deepcopy`` of a CPU tensor copies its storage.

        PyTorch's default for a wrapper subclass clones, then deep-copies the instance's
        ``__dict__`` over the clone's: the copy took a *copy of the original's cell*, which
        no trace knows. Copied while pending (lazy mode, before ``mark_step``: an optimizer's
        ``state_dict()``, a model's BatchNorm buffers, an EMA model made mid-step), its value
        index pointed into a trace already run, and read another trace's value at that index
        or failed at the next flush (KeyError)."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            return torch.Tensor.__deepcopy__(self, memo)       # PyTorch's error for non-leaves
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        extra = {k: v for k, v in self.__dict__.items() if k not in ("_kc", "_ksig")}
        if extra:                                   # attributes a user set on the tensor
            new.__dict__.update(copy.deepcopy(extra, memo))
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol):
        # torch.save writes the host data as an ordinary CPU tensor, so torch.load with
        # weights_only=True reads it; load_state_dict copies it back onto the device. Not a
        # copy: device tensors that share memory (a tensor and its views) share their host
        # storage, which torch.save then writes once and torch.load shares again, as on the
        # CPU (a copy each wrote them apart, and the loaded view no longer saw its base)
        return self.host().detach().__reduce_ex__(protocol)


def any_in(tree) -> bool:
    """Whether a device tensor is among ``tree``'s items (nested lists and tuples too)."""
    for a in tree:
        if isinstance(a, DeviceTensor) or (isinstance(a, (list, tuple)) and any_in(a)):
            return True
    return False


def signature(like) -> tuple:
    """``(dtype, shape, strides, offset, True)``: a device tensor's fixed signature (see
    :func:`kiln.device.replay.walk`), for one shaped like ``like``."""
    return (like.dtype, like.shape, like.stride(), like.storage_offset(), True)


def made(sig: tuple, cell: Cell) -> DeviceTensor:
    """A device tensor with signature ``sig`` holding ``cell``."""
    device = _TORCH_DEVICE[0]
    if device is None:
        device = _TORCH_DEVICE[0] = torch.device(_DEVICE[0], 0)
    t = torch.Tensor._make_wrapper_subclass(
        DeviceTensor, sig[1], strides=sig[2], storage_offset=sig[3], dtype=sig[0], device=device,
        requires_grad=False)
    t._kc = cell
    t._ksig = sig
    return t


def wrap(data: torch.Tensor) -> DeviceTensor:
    """A concrete device tensor over ``data`` (a CPU tensor), no copy."""
    return DeviceTensor(data, Cell(data=data))


def pending(meta: torch.Tensor, value: int) -> DeviceTensor:
    """A pending device tensor shaped like ``meta`` (a meta tensor)."""
    return DeviceTensor(meta, Cell(value=value))


def alias(t: DeviceTensor, like) -> DeviceTensor:
    """A whole-tensor alias of ``t`` (``detach``, ``.data``): the same cell."""
    return DeviceTensor(like, t._kc)


def note_view(view: DeviceTensor, base: DeviceTensor, func, args, kwargs, index):
    """Record that ``view`` was made from ``base`` by ``func`` (its output ``index``)."""
    view._kc.base = (weakref.ref(base), func, tuple(args[1:]), kwargs, index)
    cell = base._kc
    if cell.views is None:
        cell.views = weakref.WeakSet()
    cell.views.add(view._kc)
