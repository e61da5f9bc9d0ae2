"""The device's memory figures and ``torch.accelerator``'s calls that need a C++ backend.

kiln's device keeps its tensors in host memory and has no allocator of its own, so
PyTorch's generic calls, once the device is the current accelerator (it is wherever kiln
is installed, CPU-only scripts included), failed: ``torch.accelerator.memory_allocated()``
and its siblings with ``device_allocator INTERNAL ASSERT FAILED`` ("Allocator for kiln is
not a DeviceAllocator"), ``torch.accelerator.synchronize()`` with "Backend doesn't support
synchronizing all streams". A Python backend cannot give PyTorch those C++ hooks, so
:func:`install` routes these calls, for kiln's device only, here:

* ``synchronize``: runs what the device has queued or recorded (as ``torch.kiln.synchronize``).
* ``memory_stats`` and what reads it (``memory_allocated``, ``max_memory_allocated``,
  ``memory_reserved``...): ``allocated_bytes.all.current`` is the host memory that live
  device tensors hold, counted when asked (a walk of the live objects: a logging call's
  cost, not a per-operation one). kiln tracks no allocation by allocation, so the peaks
  and the reserved figures are the process's resident memory (now, and its peak since
  start), an upper bound that includes everything the process holds.
* ``empty_cache``, ``reset_peak_memory_stats``: nothing to free or reset (no cache; the
  process's peak cannot be reset). ``get_memory_info``: the host's free and total memory.

``torch.kiln`` (or ``torch.neuron``) has the same functions, under CUDA's names.
"""
from __future__ import annotations

import collections
import gc
import os
import resource

import torch


def _is_kiln(device=None) -> bool:
    from kiln.device import tensor as dt
    if device is not None and not isinstance(device, int):
        return torch.device(device).type == dt.device_type()
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == dt.device_type()


def allocated_bytes() -> int:
    """Host bytes held by live device tensors' data (each storage once)."""
    from kiln.device.tensor import DeviceTensor
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is not DeviceTensor:
            continue
        data = obj._kc.data
        if not isinstance(data, torch.Tensor):
            continue                        # pending, or promised by a program in flight
        storage = data.untyped_storage()
        key = storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # KiB on Linux


def memory_stats(device=None) -> collections.OrderedDict:
    current, peak, rss = allocated_bytes(), _peak_rss(), _rss()
    return collections.OrderedDict(sorted({
        "allocated_bytes.all.current": current, "allocated_bytes.all.peak": max(peak, current),
        "reserved_bytes.all.current": max(rss, current), "reserved_bytes.all.peak": max(peak, rss, current),
    }.items()))


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def mem_get_info(device=None) -> tuple:
    """``(free, total)`` bytes of the host's memory, which is the device's."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]


def empty_cache() -> None:
    """Nothing cached: freed device tensors' memory goes back to the host at once."""


def reset_peak_memory_stats(device=None) -> None:
    """The peaks are the process's resident peak, which cannot be reset (module doc)."""


reset_accumulated_memory_stats = reset_peak_memory_stats


def synchronize(device=None) -> None:
    from kiln.device.dispatch import materialize
    materialize()


def install() -> None:
    """``torch.accelerator``'s calls above, for kiln's device (once; others unchanged)."""
    import torch.accelerator as acc
    import torch.accelerator.memory as accmem
    if getattr(acc.synchronize, "_kiln", False):
        return

    def routed(original, ours, module_name):
        def call(device_index=None, /):
            return ours(device_index) if _is_kiln(device_index) else original(device_index)
        call._kiln = True
        call.__doc__, call.__name__ = original.__doc__, module_name
        return call

    acc.synchronize = routed(acc.synchronize, synchronize, "synchronize")
    for name in ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved", "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        wrapped = routed(getattr(accmem, name), globals()[name], name)
        setattr(accmem, name, wrapped)
        if hasattr(acc, name):
            setattr(acc, name, wrapped)
    get_info = accmem.get_memory_info
    accmem.get_memory_info = routed(get_info, mem_get_info, "get_memory_info")
    if hasattr(acc, "get_memory_info"):
        acc.get_memory_info = accmem.get_memory_info
    original_empty = accmem.empty_cache

    def empty_cache_routed():
        return empty_cache() if _is_kiln() else original_empty()
    empty_cache_routed._kiln = True
    accmem.empty_cache = empty_cache_routed
    if hasattr(acc, "empty_cache"):
        acc.empty_cache = empty_cache_routed
