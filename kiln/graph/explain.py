"""Where a captured graph's nodes came from, and why a capture failed, in the user's terms:
the innermost source line outside torch itself, from the stack traces torch.export records."""
from __future__ import annotations

import linecache
import os
import re
import sys

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
# What torch says when a view's strides do not allow it (fake/meta tensors, then eager).
VIEW_FAILURES = ("Cannot view a tensor with shape", "view size is not compatible with input tensor")

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def user_frame(stack_trace: str | None) -> str | None:
    """``file:line`` of the innermost frame outside torch itself, from an fx stack trace."""
    if not stack_trace:
        return None
    frames = _FRAME.findall(stack_trace)
    if not frames:
        return None
    outside = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    path, line, func, code = (outside or frames)[-1]
    return f"{path}:{line} in {func}: {code.strip()}"


def _real_path(path: str) -> str:
    """``path``, or the imported module's file it is the tail of: torch cuts the start off the
    path in some messages ("Caused by: (mp/probe/m.py:30 in forward)" for /tmp/probe/m.py)."""
    if os.path.exists(path):
        return path
    parts = path.strip("/").split("/")
    for k in range(len(parts)):
        tail = "/" + "/".join(parts[k:])
        for module in list(sys.modules.values()):
            f = getattr(module, "__file__", None)
            if isinstance(f, str) and f.endswith(tail):
                return f
    return path


def explain_export_failure(exc: Exception, model_name: str, stage: str | None = None) -> str:
    """Turn a torch.export failure into a short message pointing at the user's line.
    ``stage`` names a later step that failed (decomposition) instead of export itself."""
    text = str(exc)
    kind = type(exc).__name__
    frames = [f for f in _FRAME.findall(text) if not f[0].startswith(_TORCH_DIR)]
    where = ""
    if frames:
        path, line, func, code = frames[-1]
        where = f"\n  at {path}:{line} in {func}: {code.strip()}"
    else:
        m = re.search(r'\(([^\s()"]+\.py):(\d+) in (\S+)\)', text) or re.search(r'(/[^\s"]+\.py):(\d+)', text)
        path = _real_path(m.group(1)) if m else _TORCH_DIR
        if not path.startswith(_TORCH_DIR):
            line = int(m.group(2))
            code = linecache.getline(path, line).strip()
            where = f"\n  at {path}:{line}" + (f" in {m.group(3)}: {code}" if m.lastindex == 3 and code else "")
    if "data-dependent" in text or "GuardOnDataDependent" in kind or "DataDependent" in kind:
        why = ("the model branches or sizes something on a tensor's *value* (data-dependent control "
               "flow), which a compiled static graph cannot represent")
        fix = ("make the branch independent of tensor values, or use torch.cond / torch._check "
               "to express it")
    elif "Unsupported" in kind or "not supported" in text.lower():
        why = "the model uses a Python construct torch.export cannot trace"
        fix = "simplify that code path or move it outside the model's forward()"
    elif stage:
        why = f"{stage} failed ({kind})"
        fix = ("see the cause below; run torch.export.export(model, args).run_decompositions() "
               "directly for the full report")
        if any(s in text for s in VIEW_FAILURES):
            fix = ("torch's decomposition lays this tensor out differently from eager, and kiln "
                   "cannot turn the view into a reshape because the view is modified in place; "
                   "use an out-of-place op on it (y = y * 2, not y.mul_(2))")
    else:
        why = f"torch.export failed ({kind})"
        fix = "see the cause below; run torch.export.export(model, args) directly for the full report"
    first = text.strip().splitlines()[0] if text.strip() else kind
    return (f"cannot capture {model_name}: {why}.{where}\n  cause: {first[:400]}\n  fix: {fix}")
