"""Scratch directories for an engine's intermediate files, in shared memory where it has room.

Why: ONNX Runtime and OpenVINO take models as files, so a build writes the exported model,
ORT writes its optimized model and weights back, and kiln reads them in again, each as
large as the partition's weights. For SmolLM2-135M in float32 that is three writes of
660 MB per graph. On a disk they are slow and vary with whatever else writes: measured on
the 2-core machine while the test suite ran, 660 MB took 4.2 s to write to ``/tmp`` and
0.29 s to ``/dev/shm``. The files live only for the length of one build, so memory is the
right place for them when there is room; nothing that outlives the call goes there.

Only data files go there, never code: ``/dev/shm`` is often mounted ``noexec``, so the
Inductor engine's shared libraries keep the ordinary temp directory.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

SHARED_MEMORY = "/dev/shm"
# room left over what the caller says it needs, so a build never fills the machine's memory
MARGIN = 1 << 30


def root_for(need_bytes: int) -> str | None:
    """Where a scratch directory for ``need_bytes`` of files goes: shared memory when it
    is a directory with that much free plus :data:`MARGIN`, else None (the temp dir)."""
    try:
        st = os.statvfs(SHARED_MEMORY)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return SHARED_MEMORY if free >= need_bytes + MARGIN else None


@contextlib.contextmanager
def directory(prefix: str, need_bytes: int = 0):
    """A fresh directory, removed on exit, for up to ``need_bytes`` of files (see the
    module's docstring)."""
    where = root_for(need_bytes)
    try:
        path = tempfile.mkdtemp(prefix=prefix, dir=where)
    except OSError:
        if where is None:
            raise
        path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def tensor_bytes(graph_module) -> int:
    """Bytes of the tensors a graph reads as attributes (its weights): about what one copy
    of its model file takes."""
    import torch
    seen, total = set(), 0
    for node in graph_module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = graph_module
        for part in node.target.split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor) and (value.data_ptr(), value.numel()) not in seen:
            seen.add((value.data_ptr(), value.numel()))
            total += value.numel() * value.element_size()
    return total
