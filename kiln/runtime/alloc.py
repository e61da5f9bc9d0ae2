"""Large buffers sized by a file or a setting, refused with a kiln error instead of the allocator's.

A KV cache's shape comes from an LLM artifact, a benchmark's inputs from an artifact's
input specs and ``--batch-sizes``: a large number there ended in torch's own
``RuntimeError: [enforce fail at alloc_cpu.cpp] ... you tried to allocate N bytes`` (or
"Storage size calculation overflowed"), naming neither the buffer nor the setting. Worse,
a size between the memory free and what the kernel lets a process map is not refused at
all: zero-filling it runs the machine out of memory, and the out-of-memory killer ends
the process (or another one). So the size is checked first, against the host's available
memory for a CPU buffer, and an allocation that fails anyway (a device's memory, a limit
the check cannot see) is reported the same way: what it was for, its shape, the bytes
asked for and what to change.
"""
from __future__ import annotations

import math

import torch

from kiln.errors import KilnError


def nbytes(shape, dtype, count: int = 1) -> int:
    """Bytes of ``count`` buffers of ``shape`` and ``dtype`` (Python integers: no overflow)."""
    return count * math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()


def host_available() -> int | None:
    """Bytes of memory the host can give a process now (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int((fields.get("MemAvailable") or fields["MemFree"]).split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.1f} GiB)"


def check(what: str, shape, dtype, advice: str, count: int = 1, device="cpu") -> int:
    """Raise :class:`KilnError` unless ``count`` buffers of ``shape`` can be allocated on
    ``device``, as far as can be told before trying (a CPU's available memory); the bytes."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise KilnError(f"{what}: shape {list(shape)} is not a list of non-negative integers; {advice}")
    need = nbytes(shape, dtype, count)
    if torch.device(device).type == "cpu":
        available = host_available()
        if available is not None and need > available:
            raise KilnError(f"{what} of shape {list(shape)} ({dtype}{f', {count} of them' if count > 1 else ''}) "
                            f"needs {_size(need)}; this host has {_size(available)} available. {advice}")
    return need


def allocate(make, what: str, shape, dtype, advice: str, count: int = 1, device="cpu"):
    """``make()`` (which allocates the ``count`` buffers), after :func:`check`; an allocator's
    failure becomes a :class:`KilnError` naming the buffer, its size and ``advice``."""
    need = check(what, shape, dtype, advice, count, device)
    try:
        return make()
    except (RuntimeError, MemoryError) as e:      # torch.OutOfMemoryError is a RuntimeError
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise KilnError(f"{what} of shape {list(shape)} ({dtype}{f', {count} of them' if count > 1 else ''}) "
                        f"needs {_size(need)} on {device}, which could not be allocated ({first}). "
                        f"{advice}") from None
