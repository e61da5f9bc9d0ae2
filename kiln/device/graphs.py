"""One FX graph PyTorch hands over at run time, through kiln's compiler.

``torch.compile``'s AOTAutograd (and, later, a lazy device's ``mark_step``) gives kiln
a graph of ATen operations over flat tensors, with *fake* example inputs (shapes and
dtypes, no data). kiln compiles ahead of time against real values (it checks the
compiled graph against eager PyTorch), so the examples are made real here: random
normal floats, zeros for integers and booleans (an index of 0 is valid for any
embedding or gather). Parameters and buffers are graph *inputs* in these graphs, never
constants, so a training step's new weights flow in on every call.

Graphs are compiled ``whole_graph``: when the first engine would leave operations on
the host (a training graph's ``convolution_backward`` on ONNX Runtime), an engine that
takes every operation (Inductor) compiles the whole graph instead.

A graph kiln cannot compile (an operation no engine and no host kernel takes, a check
against eager that fails, symbolic shapes) runs eagerly as PyTorch traced it, with a
warning that names why: never a crash, never a silently wrong answer.
"""
from __future__ import annotations

import hashlib
import time
import warnings

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from kiln.compiler.api import trace
from kiln.device import metrics
from kiln.errors import KilnError


def structure_of(gm: torch.fx.GraphModule) -> str:
    """A digest of the graph's operations and wiring, not its shapes: the same graph
    compiled for another shape has the same structure."""
    text = []
    for node in gm.graph.nodes:
        text.append(f"{node.op}:{node.target}:{[str(a) for a in node.args]}")
    return hashlib.sha256("\n".join(text).encode()).hexdigest()[:16]


def _readers(gm) -> list:
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            users = [u for u in node.users if u.op == "call_function"]
            out.append(str(users[0].target) if users else "unused")
    return out


def real_example(x):
    """A real tensor like ``x`` (fake or real): random normal floats, zeros otherwise."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = tuple(int(d) for d in x.shape)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return torch.randn(shape, dtype=x.dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(shape, dtype=x.dtype)


def _symbolic(inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and not all(isinstance(d, int) for d in x.shape) for x in inputs)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, name: str, real_inputs=False, **options):
    """A callable ``f(*tensors) -> list of tensors``: ``gm`` compiled by kiln, or ``gm``
    itself (eager) with a warning when it cannot be. ``real_inputs``: the examples are
    real data (a device's flush), used as they are."""
    inputs = list(example_inputs)
    # a training graph split around host operations runs slower than one compiled whole
    options.setdefault("whole_graph", True)
    ops = sum(n.op == "call_function" for n in gm.graph.nodes)
    metrics.sample("TensorsGraphSize", ops)
    if _symbolic(inputs):
        return _eager(gm, name, "its shapes are symbolic (dynamic); kiln compiles static shapes: "
                                "use torch.compile(..., dynamic=False)")
    shapes = [tuple(int(d) for d in x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
    metrics.note_compile(structure_of(gm), shapes, _readers(gm), f"graph '{name}' ({ops} ops)")
    started = time.perf_counter()
    # the caller may be tracing under a fake mode (AOTAutograd is): kiln compiles and
    # checks with real tensors
    with unset_fake_temporarily():
        try:
            examples = tuple(inputs) if real_inputs else tuple(real_example(x) for x in inputs)
            compiled = trace(gm, examples, name=name, quiet=True, **options)
            misfit = _misfit(compiled, gm) if compiled.manifest.get("cache", {}).get("hit") else None
            if misfit:                 # never run another graph's artifact: compile afresh
                warnings.warn(f"kiln: graph '{name}': the compile cache's entry does not fit it "
                              f"({misfit}); compiling it again", RuntimeWarning, stacklevel=2)
                compiled = trace(gm, examples, name=name, quiet=True, **{**options, "cache": False})
            compiled.take_turns()      # it runs between host operations, never back to back
        except KilnError as e:
            return _eager(gm, name, str(e))
        except Exception as e:       # torch itself failing on the graph: still never a crash
            return _eager(gm, name, f"{type(e).__name__}: {e}")
    metrics.sample("CompileTime", time.perf_counter() - started)
    hit = bool(compiled.manifest.get("cache", {}).get("hit"))
    metrics.count("CachedCompile" if hit else "UncachedCompile")
    # a backward graph returns None for inputs without gradients; the compiled graph
    # returns its tensors only, so the Nones are put back where the graph had them
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    present = [o is not None for o in outputs]

    def run(*args):
        t0 = time.perf_counter()
        flat = iter(compiled.run_flat(list(args)))
        out = [next(flat) if p else None for p in present]
        metrics.sample("ExecuteTime", time.perf_counter() - t0)
        return out
    run.compiled = compiled
    return run


def _misfit(compiled, gm) -> str | None:
    """Why a compiled model's outputs cannot be ``gm``'s (their shapes and dtypes against
    the graph's own metadata, where it has some), or None. A cache hit trusts its key;
    this catches a key that named the wrong entry (as one once did)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = [o for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs]) if o is not None]
    vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in outputs]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    specs = compiled.output_specs
    if len(specs) != len(vals):
        return f"{len(specs)} outputs, the graph has {len(vals)}"
    for i, (spec, val) in enumerate(zip(specs, vals)):
        if tuple(spec.shape) != tuple(val.shape) or spec.dtype != val.dtype:
            return f"output {i} is {spec.dtype}{list(spec.shape)}, the graph's {val.dtype}{list(val.shape)}"
    return None


def _eager(gm, name, why):
    warnings.warn(f"kiln: graph '{name}' runs eagerly (not compiled): {why}", RuntimeWarning, stacklevel=3)
    metrics.count("EagerGraphs")

    def run(*args):
        out = gm(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]
    run.compiled = None
    return run
