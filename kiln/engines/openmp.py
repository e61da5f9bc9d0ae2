"""Per-call thread counts for engines whose kernels run on torch's OpenMP runtime.

``torch.set_num_threads`` is process-wide: one model's setting would change
every other model's. OpenMP's ``omp_set_num_threads`` is per calling thread,
so an engine sets it around each call (``threads(n)``) and restores it after;
kernels that size their parallel regions from ``omp_get_max_threads`` (ATen's
``parallel_for``, AOTInductor's C++ with dynamic threads) then use ``n``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os


@functools.lru_cache(maxsize=1)
def openmp_runtime():
    """The OpenMP runtime already in this process (torch's, which the kernels bind to), or None.

    Only one library per soname is ever loaded, so ``RTLD_NOLOAD`` finds the
    very runtime the kernels' ``-lgomp`` resolved to, without loading another.
    """
    for name in ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1))
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            lib.omp_get_max_threads.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


@contextlib.contextmanager
def threads(n: int):
    """Run the block with ``n`` OpenMP threads on this thread (no-op without OpenMP)."""
    omp = openmp_runtime()
    if omp is None:
        yield
        return
    import torch
    torch.get_num_threads()              # let torch initialise this thread's OpenMP first
    previous = omp.omp_get_max_threads()
    omp.omp_set_num_threads(n)
    try:
        yield
    finally:
        omp.omp_set_num_threads(previous)
