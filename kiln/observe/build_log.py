"""``KILN_BUILD_LOG``: one JSON line per compiled partition, from every process.

A compile's choices are in its artifact's manifest, but the graphs the device and
``torch.compile`` compile never become a file the user sees, and the processes a job
starts (the device's compile process, torchrun ranks, ``kiln llm compile``'s workers)
each compile their own. When a build is refused (it failed the check against eager) and
the next engine takes the graph, the only sign is that compiling took longer: ONNX
Runtime's training-mode batch norm was refused that way for every CNN, unnoticed until
such a log was made by hand (docs/performance.md, 11-28). With ``KILN_BUILD_LOG`` set to a
file, every partition kiln compiles appends a line: the model, the partition, its
operators, every engine tried (build seconds, and ``ok``, ``inaccurate`` with the
difference from eager, ``failed`` with the error, or ``skipped``), the one kept and why,
and the operators left on the host. A compile-cache hit compiles nothing and writes nothing.

Each line is one ``write`` to a file opened for appending, so lines from processes that
share the file do not interleave. A log that cannot be written warns once and never
fails the compile.
"""
from __future__ import annotations

import json
import os
import time
import warnings

from kiln import config

_warned = False


def enabled() -> bool:
    return bool(config.get("KILN_BUILD_LOG"))


def record(entry: dict):
    """Append ``entry`` (with the time and this process's id) as one line, if the log is on."""
    global _warned
    path = config.get("KILN_BUILD_LOG")
    if not path:
        return
    line = json.dumps({"time": round(time.time(), 3), "pid": os.getpid(), **entry}, default=str) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        if not _warned:
            _warned = True
            warnings.warn(f"kiln: KILN_BUILD_LOG={path!r} cannot be written ({e}); builds are not logged",
                          RuntimeWarning, stacklevel=2)
