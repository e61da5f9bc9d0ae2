"""Freed memory kept for the next call: glibc's malloc told not to hand a step's buffers back
to the kernel, in processes that run compiled programs.

A compiled graph, called again and again, allocates and frees the same buffers on every
call (AOTInductor's intermediates, ONNX Runtime's and OpenVINO's outputs, the tensors
between partitions). glibc's malloc gives memory back to the kernel when the free space at
the top of its heap passes a *trim threshold*, and serves blocks above an *mmap threshold*
with fresh mappings that are unmapped on free. Both adapt (up to 32 and 64 MiB) but not to
a working set of many medium blocks, so each call took its pages back from the kernel as
page faults, every one a zeroed 4 KiB page. Measured on the 2-core machine
(``torch.compile(backend="kiln")`` training the CNN of ``benchmarks/train.py``, 90 steps):
6,500 minor faults a step and 23-29 ms a step, against no faults and 13-15 ms with the
settings below. The same step compiled in the same process ran at 14 ms with 860 faults:
the compile's own large frees had raised glibc's thresholds, so how fast a model ran
depended on whether it came from the compile cache. PyTorch eager and Inductor fault the
same way (1,500-4,100 faults a step on this step, in the same measurements).

So the first compiled model a process loads sets (``mallopt``):

* ``M_MMAP_THRESHOLD`` to 32 MiB, glibc's largest: smaller blocks come from the heap;
* ``M_TRIM_THRESHOLD`` to ``KILN_MALLOC_KEEP`` (default 1 GiB): up to that much freed
  memory stays mapped for the next call instead of going back to the kernel.

The process's resident memory then stays near its peak, up to that bound, as with any
caching allocator (jemalloc's and tcmalloc's defaults do the same, and PyTorch's own
CPU tuning guide suggests them). ``KILN_MALLOC_KEEP=0`` leaves glibc as it is. Nothing
is changed where the C library is not glibc, where another allocator is preloaded
(jemalloc, tcmalloc, mimalloc), or where the user tuned glibc's malloc already
(``GLIBC_TUNABLES`` with ``glibc.malloc.*``, or ``MALLOC_*_`` variables).
"""
from __future__ import annotations

import ctypes
import os
import threading

from kiln import config
from kiln.errors import KilnError

M_TRIM_THRESHOLD = -1           # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20   # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)

_lock = threading.Lock()
_state: dict = {}


def keep_freed_memory() -> dict:
    """Apply the settings once per process (later calls return what the first did):
    ``{"applied": bool, "keep_bytes": int, "reason": str}``."""
    with _lock:
        if not _state:
            _state.update(_apply())
        return dict(_state)


def state() -> dict:
    """What :func:`keep_freed_memory` did in this process (``{}`` before it ran)."""
    with _lock:
        return dict(_state)


def keep_bytes() -> int:
    """``KILN_MALLOC_KEEP`` in bytes (``1G``, ``512M``, a number; 0 turns this off)."""
    try:
        return config.parse_size(config.get("KILN_MALLOC_KEEP") or "0", binary=True)
    except ValueError:
        raise KilnError(f"KILN_MALLOC_KEEP={config.get('KILN_MALLOC_KEEP')!r}: expected a size such as "
                        "1G or 512M, or 0 to leave glibc's malloc as it is") from None


def describe() -> str:
    """What loading a compiled model does (or did) to this process's malloc, in words
    (``kiln doctor``)."""
    done = state()
    if done:
        return ("kept: " if done["applied"] else "left alone: ") + done["reason"]
    keep, _, reason = _decision()
    if reason:
        return f"left alone: {reason}"
    return f"a compiled model's load keeps up to {keep >> 20} MiB of freed memory mapped (KILN_MALLOC_KEEP)"


def _decision() -> tuple:
    """(bytes to keep, glibc, why nothing will be done or '')."""
    keep = keep_bytes()
    if keep <= 0:
        return 0, None, "KILN_MALLOC_KEEP=0"
    reason = _user_choice()
    if reason:
        return 0, None, reason
    libc = _glibc()
    if libc is None:
        return 0, None, "the C library is not glibc"
    return min(keep, (1 << 31) - 1), libc, ""     # mallopt takes an int


def _apply() -> dict:
    keep, libc, reason = _decision()
    if reason:
        return {"applied": False, "keep_bytes": 0, "reason": reason}
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and libc.mallopt(M_TRIM_THRESHOLD, keep) == 1
    if not ok:
        return {"applied": False, "keep_bytes": 0, "reason": "glibc's mallopt refused the settings"}
    return {"applied": True, "keep_bytes": keep, "reason": f"mmap threshold 32 MiB, trim threshold {keep} bytes"}


def _user_choice() -> str:
    """Why the process's allocator is someone else's decision, or ''."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in preload:
            return f"{name} is preloaded"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc.*"
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        if name in os.environ:
            return f"{name} is set"
    return ""


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version                     # glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None
