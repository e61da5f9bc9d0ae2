"""``torch_xla.debug.profiler`` (``import torch_xla.debug.profiler as xp``) on kiln.

* ``StepTrace(name, step_num=None)``: a training step's span; ``mark_step()`` on leaving it,
  as torch_xla's does (a loop written ``with xp.StepTrace("train", step_num=i):`` has no
  other step boundary, so without it the lazy program would grow step after step).
* ``Trace(name)`` and ``trace_me(name)``: spans, as ``torch.profiler.record_function``
  ranges, so they appear in PyTorch's own profiler traces.
* ``start_server(port)``: torch_xla's profiler server, which TensorBoard's capture tool asks
  for a trace. kiln has none; the call warns once and names what to use instead
  (``torch.profiler``, ``kiln.profile``), and the script runs on.
* ``trace(service_addr, logdir, ...)`` (capture from that server) raises with the same advice.
"""
from __future__ import annotations

import functools
import warnings

import torch

_ADVICE = ("use torch.profiler.profile(...) around the steps (xp.Trace and xp.StepTrace spans appear in it) "
           "or kiln.profile('trace.json')")
_warned: list = []


class Trace(torch.profiler.record_function):
    """A named span (``with xp.Trace("forward"):``)."""

    def __init__(self, name: str, **kwargs):
        super().__init__(name)


class StepTrace(Trace):
    """A training step's span; ``mark_step()`` when it closes."""

    def __init__(self, name: str, step_num=None, **kwargs):
        super().__init__(name if step_num is None else f"{name} {step_num}")

    def __exit__(self, *exc):
        super().__exit__(*exc)
        from kiln.compat import xla_model
        xla_model.mark_step()
        return False


def trace_me(name: str):
    """A decorator: the function's calls are :class:`Trace` spans."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)
        return traced
    return wrap


class ProfilerServer:
    """What :func:`start_server` returns; it serves nothing."""

    def __init__(self, port: int):
        self.port = port


def start_server(port: int, only_on_master: bool = True):
    if not _warned:
        _warned.append(True)
        warnings.warn(f"xp.start_server({port}): kiln has no profiler server for TensorBoard to capture "
                      f"from; {_ADVICE}", RuntimeWarning, stacklevel=2)
    return ProfilerServer(port)


def trace(service_addr: str, logdir: str, duration_ms: int = 1000, *args, **kwargs):
    raise NotImplementedError(f"xp.trace({service_addr!r}, ...): kiln has no profiler server to capture from; "
                              f"{_ADVICE}")


trace_detached = trace
