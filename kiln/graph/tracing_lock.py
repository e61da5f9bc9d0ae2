"""One trace at a time in a process, and none while Dynamo compiles (:func:`held`)."""
from __future__ import annotations

import threading

_LOCK: list = []     # the lock, found at the first trace


def held():
    """One trace at a time in a process, and none while Dynamo compiles. torch.export and
    make_fx keep their tracer in process-wide slots (the proxy dispatch mode, the module
    hierarchy being exported) and patch ``nn.Module.__call__`` while they trace: three of
    four kiln.trace calls from four threads failed ("ProxyTorchDispatchMode slot already
    occupied", "_EXPORT_MODULE_HIERARCHY must not be None"), and torch.compile's first calls
    from several threads failed with "CURRENT_PATCHER is None", or Dynamo, tracing the model
    on another thread, traced into the patched call ("Guard failed on the same frame it was
    created"). Dynamo's own compile lock (re-entrant) serves, so the two take turns; a
    private lock where Dynamo has none. Re-entrant: a trace may capture again on its thread."""
    if not _LOCK:
        try:                     # imported here: importing Dynamo costs ~1 s, and tracing imports it anyway
            from torch._dynamo.convert_frame import compile_lock
        except (ImportError, AttributeError):
            compile_lock = threading.RLock()
        _LOCK.append(compile_lock)
    return _LOCK[0]


def mine() -> bool:
    """Whether this thread holds the lock (a compile waiting on another thread that would
    trace must then trace on this one instead, or wait for itself)."""
    owned = getattr(held(), "_is_owned", None)
    return bool(owned and owned())
