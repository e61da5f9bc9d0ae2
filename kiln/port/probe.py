"""Dynamo's view of the model: where it breaks into several graphs, and why.

``torch.export`` (kiln's capture) needs one graph; when it cannot have one, Dynamo — which
``torch.compile`` uses — still traces the model as several graphs split at the lines it
cannot trace. Recording those graphs (a backend that keeps each graph and its example
inputs, then runs it as it is) gives the break reasons at the user's lines and graphs
kiln's analysis can still place op by op.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field

import torch

from kiln.graph.explain import user_frame


@dataclass
class Break:
    reason: str
    where: str | None


@dataclass
class Probe:
    graphs: list = field(default_factory=list)     # [(GraphModule, [example inputs])]
    breaks: list = field(default_factory=list)     # [Break]
    error: str | None = None                       # Dynamo itself failed


def probe(subject) -> Probe:
    """Trace ``subject`` with Dynamo, recording each graph and each break."""
    out = Probe()

    def record(gm, example_inputs):
        out.graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            explained = torch._dynamo.explain(subject.model)(*subject.args, **subject.kwargs)
            torch._dynamo.reset()
            torch.compile(subject.model, backend=record)(*subject.args, **subject.kwargs)
    except Exception as e:   # Dynamo's own failures are many kinds; each is reported, none is fatal
        out.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        return out
    finally:
        torch._dynamo.reset()
    seen = set()
    for r in explained.break_reasons:
        frames = [f for f in r.user_stack if "/torch/" not in f.filename]
        frame = (frames or r.user_stack or [None])[-1]
        where = f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else None
        key = (r.reason, where)
        if key not in seen:
            seen.add(key)
            out.breaks.append(Break(_plain(r.reason), where))
    return out


def _plain(reason: str) -> str:
    first = reason.strip().splitlines()[0] if reason.strip() else "graph break"
    return first[:300]


def origin(node, by_name: dict) -> str | None:
    """The user's line for an ATen node captured from one of Dynamo's graphs: the Dynamo
    node it came from (``from_node``'s deepest name; ``by_name`` maps that graph's node
    names to its nodes) carries the model's own stack trace."""
    names = []
    sources = list(node.meta.get("from_node") or [])
    while sources:
        s = sources.pop(0)
        names.append(s.name)
        sources = list(s.from_node or []) + sources
    for name in reversed(names):
        if name in by_name:
            where = user_frame(by_name[name].meta.get("stack_trace"))
            if where:
                return where
    return None
