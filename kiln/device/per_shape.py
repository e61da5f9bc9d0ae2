"""A ``torch.compile`` graph with symbolic shapes, compiled once per concrete shape.

Dynamo's default (``dynamic=None``, "automatic dynamic shapes") recompiles a function
whose input shapes changed with those dimensions symbolic. kiln compiles static shapes,
so until 11-30 such a graph ran eagerly (with a warning) for good: a model called with
a second sequence length, or a second batch size, was compiled for its first shape and
ran op by op for every other. Neuron's own ``torch.compile`` backend compiles a graph
per shape too.

Here the symbolic graph is re-traced for each concrete shape it is called with
(``make_fx`` on fake copies of the call's tensors: the graph's own ATen operations, none
of the model's Python), which gives the static graph the shape's sizes bake in, and
that graph is compiled like any other (:func:`kiln.device.graphs.compile_graph`: engines
by measurement, the check against eager on that call's values). Sizes the graph
returns (AOTAutograd's forward hands its backward the sizes it saved) are constants
of the shape, returned beside the compiled outputs. A shape is compiled at its second
call (:data:`SIGHTINGS`): the first runs eagerly, so shapes that never come back (a
decode loop's growing lengths) cost no compile. At most :data:`MAX_SHAPES` shapes are
compiled per graph, as Dynamo's own recompile limit; further shapes run eagerly, with one
warning saying so.
"""
from __future__ import annotations

import threading
import warnings

import torch

from kiln.graph import tracing_lock

# shapes compiled per graph (Dynamo's default recompile_limit is 8 as well)
MAX_SHAPES = 8
# calls of a shape before it is compiled: a shape met once (each step of a decode loop
# whose length grows) runs eagerly rather than pay a compile it never reuses; one that
# comes back (a training loop's batch sizes, a server's padded lengths) is compiled
SIGHTINGS = 2


def compiled_per_shape(gm, name: str, compile_static, eager, examples):
    """``f(*args) -> list``: ``gm`` (symbolic shapes) compiled by ``compile_static(static_gm,
    name)`` (a callable on tensors) for each concrete shape it meets; ``eager`` beyond
    :data:`MAX_SHAPES` shapes, or for a shape that cannot be specialized. ``examples``: the
    graph's example inputs, whose symbolic ones are the inputs a call's shape is read from
    (Dynamo's guards hold the others to their sizes and strides: an AOTAutograd graph's
    parameters, read on every call, cost 166 us a call for 200 of them)."""
    lock, shapes, seen, warned = threading.Lock(), {}, {}, []
    varying = [i for i, x in enumerate(examples) if _symbolic(x)]

    def run(*args):
        key = _key(args, varying)
        entry = shapes.get(key)
        if entry is None:
            with lock:
                entry = shapes.get(key)
                if entry is None:
                    seen[key] = seen.get(key, 0) + 1
                    if seen[key] < SIGHTINGS:
                        return eager(*args)
                    entry = shapes[key] = _entry(gm, name, args, len(shapes), compile_static, eager, warned)
        return entry(args)
    run.shapes = shapes
    return run


def _symbolic(x) -> bool:
    """Whether an example input varies between calls: a symbolic number, or a tensor with a
    symbolic size or stride."""
    if isinstance(x, torch.Tensor):
        return not all(isinstance(d, int) for d in (*x.shape, *x.stride()))
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _key(args, varying) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.stride(), a.requires_grad) if isinstance(a, torch.Tensor)
                 else (type(a).__name__, a) for a in (args[i] for i in varying))


def _entry(gm, name, args, count, compile_static, eager, warned):
    if count >= MAX_SHAPES:
        if not warned:
            warned.append(True)
            warnings.warn(f"kiln: graph '{name}' met more than {MAX_SHAPES} input shapes; kiln compiles one "
                          "program per shape, and runs further shapes eagerly (pad inputs to a few sizes, "
                          "or use kiln.trace with buckets)", RuntimeWarning, stacklevel=4)
        return lambda call: eager(*call)
    try:
        static, tensors, constants = _specialize(gm, args)
    except Exception as e:  # noqa: BLE001 - a graph make_fx cannot re-trace: eager, with the reason
        return _eager_for(eager, name, f"its symbolic shapes could not be made concrete "
                                       f"({type(e).__name__}: {e})")
    run = compile_static(static, name)

    def call(call_args):
        outs = iter(run(*(call_args[i] for i in tensors)))
        return [next(outs) if c is _TENSOR else c for c in constants]
    return call


_TENSOR = object()


def _specialize(gm, args):
    """``(static graph on the call's tensors, their positions, the outputs: _TENSOR where the
    static graph returns one, else the constant)``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    constants: list = []

    def concrete(*ts):
        full = list(args)
        for i, t in zip(tensors, ts):
            full[i] = t
        out = gm(*full)
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        constants[:] = [_TENSOR if isinstance(o, torch.Tensor) else o for o in out]
        return [o for o in out if isinstance(o, torch.Tensor)]

    with tracing_lock.held():       # make_fx's tracer lives in process-wide slots
        static = make_fx(concrete, tracing_mode="fake")(*(args[i] for i in tensors))
    if any(isinstance(c, (torch.SymInt, torch.SymFloat, torch.SymBool)) for c in constants):
        raise ValueError("an output size stayed symbolic")
    return static, tensors, constants


def _eager_for(eager, name, why):
    warnings.warn(f"kiln: graph '{name}' runs eagerly (not compiled) for this shape: {why}", RuntimeWarning,
                  stacklevel=5)
    return lambda call: eager(*call)
