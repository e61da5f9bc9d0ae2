"""A lazy-mode step's program running while the next step is recorded (``overlap=True``).

Why: recording a step is Python on one core (a 4-layer BERT's: ~60 ms), and its program
runs after it on every core (~100 ms); with the two in turn, one core idles through the
recording. torch_xla's device runs a step's graph asynchronously for the same reason.
Measured on 2 cores (``docs/device.md``): a stand-in program kept its pace at about half
while a step was recorded beside it, so a step could take ~prog + rec/2 instead of
prog + rec.

How: :func:`launch` hands the compiled program and its inputs to one worker thread
(AOTInductor's call releases the GIL: measured, a Python loop kept 0.66 of its
pace beside one on 2 busy cores) and gives each live output's cell a :class:`Promise`
in place of its data: a concrete tensor to be, whose dtype, shape and strides are known.
To the recorder a promise is host data like any other: the next step's trace takes it as
an input (by identity, as it takes host tensors), and a view of it (a weight's ``t()``)
is a promise too (:meth:`Promise.view`), so the next step records the very program it
would have recorded after a synchronous step. Whatever needs the values waits for the
program (:func:`land`): the next flush, an operation run now on the host, ``.cpu()`` and
``item()``. Landing gives the cells that still hold their promise the data (through
:func:`kiln.device.binding.bind`'s checks) and each promise its value; a cell rebound since
(the optimizer's update, recorded) keeps its new pending value.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_STATE = {"pool": None, "flight": None, "landings": 0}
_LOCK = threading.Lock()


class Promise:
    """The host data a program in flight will give a device tensor; see the module docstring."""
    __slots__ = ("flight", "index", "source", "value", "dtype", "shape", "_stride", "_offset", "__weakref__")

    def __init__(self, like, flight=None, index=None, source=None):
        self.flight, self.index, self.source, self.value = flight, index, source, None
        self.dtype, self.shape, self._stride, self._offset = like.dtype, like.shape, like.stride(), like.storage_offset()

    def stride(self):
        return self._stride

    def storage_offset(self):
        return self._offset

    def numel(self):
        return math.prod(self.shape)

    def dim(self):
        return len(self.shape)

    def view(self, func, args, meta_out) -> "Promise":
        """The promise of ``func(self, *args)``, a view shaped like ``meta_out``."""
        return Promise(meta_out, source=(self, func, args))

    def landed(self) -> bool:
        """Whether the program has run (the value is at hand without waiting)."""
        root = self
        while root.source is not None:
            root = root.source[0]
        return root.value is not None

    def get(self) -> torch.Tensor:
        """The value, once the program has run (waiting for it)."""
        if self.value is None:
            if self.source is not None:
                base, func, args = self.source
                self.value = func(base.get(), *args)
            else:
                self.flight.land()
        return self.value


class Flight:
    """One program running in the background, and the cells waiting for its outputs."""

    def __init__(self, run, inputs, live, seen, bind, name):
        """``live``: ``(cell, meta)`` for each output; ``seen``: the inputs' storages;
        ``bind``: :func:`kiln.device.binding.bind_values`."""
        self.live, self.bind, self.name, self.seen, self.error = live, bind, name, seen, None
        self.landing = False
        self.pid = os.getpid()
        self.promises = [Promise(meta, self, i) for i, (_, meta) in enumerate(live)]
        for (cell, _), promise in zip(live, self.promises):
            cell.data, cell.value = promise, None
        # held until it lands: their memory is not another tensor's meanwhile (:func:`reads`)
        self.inputs = inputs
        self.future = _pool().submit(run, *inputs)

    def land(self):
        """Wait for the program; give its cells and promises their data (once)."""
        if self.error is not None:
            raise self.error
        if self.promises is None:
            return
        if self.landing:     # a value asked for while the outputs are given out: never silently stale
            raise RuntimeError(f"kiln device: {self.name}'s outputs were asked for while they were being "
                               "given to their tensors (a view of one whose base is another); please report it")
        if os.getpid() != self.pid:
            raise RuntimeError("kiln device: this process was forked while a step's program ran in its "
                               "parent; its device tensors' values are the parent's: read them there, "
                               "or call modes.synchronize() before forking")
        try:
            results = self.future.result()
        except BaseException as e:
            self.inputs = None
            self.error = RuntimeError(f"kiln device: a step's program ({self.name}) failed while the "
                                      f"next step was recorded: {type(e).__name__}: {e}")
            raise self.error from e
        finally:
            with _LOCK:
                if _STATE["flight"] is self:
                    _STATE["flight"] = None
        # the cells still waiting for their value get it; the others were rebound meanwhile
        triples = [(cell if cell.data is promise else None, meta, data)
                   for (cell, meta), promise, data in zip(self.live, self.promises, results)]
        self.landing = True
        try:
            given = self.bind(self.seen, triples)
        finally:
            self.landing = False
        for promise, data in zip(self.promises, given):
            promise.value = data
        self.promises, self.live, self.inputs = None, None, None
        _STATE["landings"] += 1


def _forget_in_child():
    """A forked process has no worker thread: it starts its own when it launches."""
    _STATE["pool"], _STATE["flight"] = None, None


os.register_at_fork(after_in_child=_forget_in_child)


def _pool():
    with _LOCK:
        if _STATE["pool"] is None:
            _STATE["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-device-program")
        return _STATE["pool"]


def launch(run, inputs, live, seen, bind, name) -> Flight:
    """Start ``run(*inputs)`` in the background; ``live``'s cells take promises of its outputs."""
    land()                       # one program at a time, in order
    flight = Flight(run, inputs, live, seen, bind, name)
    with _LOCK:
        _STATE["flight"] = flight
    return flight


def landings() -> int:
    """How many programs have landed so far (a trace asks its promises again only after one)."""
    return _STATE["landings"]


def in_use() -> bool:
    """Whether any program has run in the background in this process (else no tensor holds
    a promise, and the dispatcher need not look for one)."""
    return _STATE["pool"] is not None


def flying() -> bool:
    """Whether a program is in flight (not landed yet)."""
    return _STATE["flight"] is not None


def reads(data: torch.Tensor) -> bool:
    """Whether the program in flight reads ``data``'s memory (a host write to it must wait)."""
    flight = _STATE["flight"]
    return flight is not None and data.untyped_storage().data_ptr() in flight.seen


def land():
    """Wait for the program in flight, if any (every value it computes is then at hand)."""
    flight = _STATE["flight"]
    if flight is not None:
        flight.land()


def resolve(data):
    """``data`` itself, or the value of the promise it is (waiting for its program)."""
    return data.get() if type(data) is Promise else data
