"""``kiln port``: try the user's actual model — capture, analysis, a -O1 compile, validation,
a short timing against eager — and say which tier it is in, what blocks it (at the user's
lines, with fixes), what it costs, with pictures.

The seeds' porting lesson: "you cannot know your tier from the marketing material; you know
it by trying to compile your actual model". So every fact here comes from running kiln's own
stages on the model, never from a list of architectures.
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
from dataclasses import dataclass, field

import torch

from kiln.compiler.driver import make_options
from kiln.errors import CaptureError, KilnError
from kiln.graph.capture import capture, from_graph
from kiln.port import cost as cost_mod
from kiln.port import findings, graphs, source
from kiln.port.probe import probe
from kiln.progress import Progress


@dataclass
class PortReport:
    model: str
    source: str
    tier: int
    blockers: list
    hazards: list
    graphs: list                      # graphs.Placed
    cost: cost_mod.Cost
    captured_whole: bool
    graph_breaks: int
    llm: dict | None = None
    notes: list = field(default_factory=list)
    pictures: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tier_text(self) -> str:
        return findings.TIER_TEXT[self.tier]

    def engine_of(self, graph: int, partition: int) -> str:
        if self.captured_whole and self.cost.engines:
            return self.cost.engines.get(partition, self.graphs[graph].engine)
        return self.graphs[graph].engine

    def to_dict(self) -> dict:
        ops = sum(g.total_ops for g in self.graphs)
        host = sum(g.host_ops for g in self.graphs)
        return {"model": self.model, "source": self.source, "tier": self.tier, "tier_text": self.tier_text,
                "captured_whole": self.captured_whole, "graph_breaks": self.graph_breaks,
                "ops": {"total": ops, "host": host, "on_engines": ops - host},
                "blockers": [b.to_dict() for b in self.blockers], "hazards": self.hazards,
                "graphs": [{"name": g.name, "engine": g.engine, "total_ops": g.total_ops, "host_ops": g.host_ops,
                            "partitions": [dict(p, engine=self.engine_of(k, p["id"])) for p in g.partitions]}
                           for k, g in enumerate(self.graphs)],
                "cost": self.cost.to_dict(), "llm": self.llm, "notes": self.notes,
                "pictures": self.pictures, "seconds": round(self.seconds, 2)}


def port(spec, *, batch_size=None, sequence_length=None, compiler_args=None, timing_budget: float = 0.5,
         quiet=None, subject=None) -> PortReport:
    """Port ``spec`` (a factory ``module:function``, a ``.py`` file or a Hugging Face
    directory; or a ready :class:`~kiln.port.source.Subject`) and report what happened."""
    started = time.perf_counter()
    progress = Progress("kiln port", quiet=quiet)
    with progress.phase("load"):
        subject = subject or source.resolve(spec, batch_size, sequence_length)
        _runs_eagerly(subject)
    options = make_options(compiler_args, optlevel=1)
    blockers, notes = [], []
    with progress.phase("dynamo probe"):
        dyn = probe(subject)
    blockers += findings.from_breaks(dyn.breaks)
    if dyn.error:
        notes.append(f"Dynamo could not trace the model: {dyn.error}")
    captured, whole = None, True
    with progress.phase("capture"), quiet_torch():
        try:
            with torch.no_grad():
                captured = capture(subject.model, subject.args, subject.kwargs)
        except CaptureError as e:
            whole = False
            blocker = findings.from_capture_error(str(e))
            if not any(b.kind == blocker.kind and b.where == blocker.where for b in blockers):
                blockers.append(blocker)
    with progress.phase("analyze"):
        placed = _place(subject, captured, dyn, options, blockers, notes)
    cost = _cost(subject, captured, dyn, options, progress, timing_budget, blockers)
    blockers = findings.merge(blockers)
    report = PortReport(subject.name, subject.source, findings.tier_of(blockers), blockers,
                        list(subject.hazards) + _hazards(subject, whole, dyn), placed, cost, whole,
                        len(dyn.breaks), _llm(subject), notes)
    report.seconds = time.perf_counter() - started
    return report


def _runs_eagerly(subject) -> None:
    """Porting starts from a model that runs: one that fails on its own example inputs in
    eager PyTorch is the user's error to fix first, said as such (not a capture failure)."""
    try:
        with torch.no_grad():
            subject.call()
    except Exception as e:   # the user's model: any error it raises is reported with its type
        raise KilnError(f"{subject.name} fails on its example inputs in eager PyTorch, before kiln does anything: "
                        f"{type(e).__name__}: {str(e).strip()[:300]}; fix the model or the example inputs "
                        f"({subject.source})") from e


@contextlib.contextmanager
def quiet_torch():
    """A failed export prints the whole graph to stderr and logs a warning per unbacked
    symbol; the blocker says it in a line, with the user's line and the fix."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch.fx.experimental.symbolic_shapes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _place(subject, captured, dyn, options, blockers, notes) -> list:
    if captured is not None:
        captured.model_name = subject.name
        placed, found = graphs.place(captured, options)
        blockers += found
        return [placed]
    out = []
    for k, (gm, example) in enumerate(dyn.graphs):
        try:
            piece = from_graph(gm, example, f"{subject.name}: Dynamo graph {k + 1}/{len(dyn.graphs)}")
        except CaptureError as e:
            notes.append(f"Dynamo graph {k + 1} could not be captured for analysis: {str(e).splitlines()[0]}")
            continue
        placed, found = graphs.place(piece, options, dynamo_gm=gm)
        out.append(placed)
        blockers += [b for b in found if not any(b.what == c.what and b.where == c.where for c in blockers)]
    return out


def _cost(subject, captured, dyn, options, progress, budget, blockers) -> cost_mod.Cost:
    try:
        if captured is not None:
            with progress.phase("compile -O1"):
                return cost_mod.traced(subject, captured, options, progress, budget)
        if dyn.graphs and not dyn.error:
            with progress.phase("torch.compile(backend='kiln')"):
                return cost_mod.dynamo(subject, options, budget)
        return cost_mod.Cost("not compiled", error="no graph could be captured")
    except KilnError as e:
        kind = "validation" if type(e).__name__ == "ValidationError" else "compile"
        blockers.append(findings.Blocker(kind, 2, f"{type(e).__name__}: {str(e).splitlines()[0]}", None,
                                         "see the message; kiln.trace(model, example) gives the full error"))
        return cost_mod.Cost("not compiled", error=str(e).splitlines()[0])


def _hazards(subject, whole, dyn) -> list:
    """What makes a deployed model recompile or refuse an input."""
    out = []
    if whole:
        shapes = [tuple(a.shape) for a in (*subject.args, *subject.kwargs.values()) if isinstance(a, torch.Tensor)]
        if subject.kind != "huggingface":
            out.append({"what": f"compiled at the example's shapes {shapes}: another shape is refused with an "
                                "error, not recompiled",
                        "fix": "list the shapes it will see: kiln.trace(..., buckets=...) pads to the nearest, "
                               "or dynamic_batch=True for any batch size"})
    elif dyn.breaks:
        out.append({"what": f"torch.compile guards each of the {len(dyn.graphs)} graphs on the values its Python "
                            "branches saw: another branch or shape recompiles at run time",
                    "fix": "remove the graph breaks (blockers above) to compile once, ahead of time"})
    return out


def _llm(subject) -> dict | None:
    """For a decoder: whether kiln's LLM path (KV cache, batching, serving) takes it."""
    arch = type(subject.model).__name__
    if subject.task != "text-generation" and not arch.endswith(("ForCausalLM", "LMHeadModel")):
        return None
    from kiln.errors import UnsupportedModelError
    from kiln.llm.decoder import check_supported
    try:
        family = check_supported(subject.model)
    except UnsupportedModelError as e:
        return {"supported": False, "why": str(e)}
    return {"supported": True, "family": family,
            "command": f"kiln llm compile {subject.source} (prefill and decode graphs, KV cache, batching)"}
