"""An attribute of torch's swapped process-wide while kiln needs it, and put back after.

kiln changes a few of torch's internals for the length of one piece of work (a capture's
``OperatorBase.py_impl``, AOTInductor's wrapper code generator). The swap is process-wide,
and two threads may do such work at once, so the replacement goes in when the first enters
and the original comes back when the last one leaves; each site owns one :class:`Swap`.
"""
from __future__ import annotations

import contextlib
import threading


class Swap:
    """``owner.name`` replaced by ``make(original)`` while any :meth:`held` is open."""

    def __init__(self, make):
        self._make = make
        self._lock = threading.Lock()
        self._depth = 0
        self._original = None

    @contextlib.contextmanager
    def held(self, owner, name: str):
        with self._lock:
            if self._depth == 0:
                self._original = getattr(owner, name)
                setattr(owner, name, self._make(self._original))
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    setattr(owner, name, self._original)
                    self._original = None
