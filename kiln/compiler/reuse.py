"""One capture for several compiles of the same model: ``with kiln.compiler.reuse_captures():``.

Capturing is the slowest part of compiling a large model that does not depend on the
compile's options: SmolLM2-135M's decode graph takes about 12 s of ``torch.export`` a
graph, each time, on 2 cores. Builds of one model in several precisions (float32, int8,
int4: what a comparison of quantizations or the LLM tests do) capture the same graphs
each time. Inside this block a graph captured once is handed to the next compile of the
same model at the same inputs.

"The same" is decided by content, never by object identity: the model's fingerprint
(:func:`kiln.compiler.fingerprint.fingerprint`: every module's class and settings, every weight
by digest, the inputs' shapes and dtypes, kiln's and torch's versions) plus a digest of
the example inputs' values (the capture computes eager's reference outputs from them).
A model changed between compiles, in weights or settings, is captured afresh. A capture
is reused only while its weights and example inputs are as they were stored (by storage
and version). Each compile gets its own copy of the graph (partitioning rewrites the graph
it is given), sharing the weights; a capture whose weights changed since is dropped, never
served.

The block also keeps each partition's ONNX export for the next build of the same
partition (:func:`kiln.engines.onnx_model.reusing_exports`): the float32 export a
quantized build starts from is the float32 build's; and each weight's quantized blocks
(:func:`kiln.engines.ort_once.sharing`): an int8 and an int4 build of one LLM compute its
output projection's Q8_0 blocks once.

Outside the block nothing is kept: the entries hold the graph and references to the
model's weights, so they live exactly as long as the block (a process that compiles one
model and moves on keeps nothing).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import operator
import threading

import torch

from kiln.compiler import fingerprint, keys
from kiln.compiler.options import CompileOptions
from kiln.engines import onnx_model, ort_once
from kiln.graph.capture import Captured, bind_inputs, capture

_local = threading.local()


@contextlib.contextmanager
def reuse_captures():
    """Within the block, compiles of a model already captured at the same inputs reuse
    that capture (see the module's docstring). Blocks nest; the outermost one owns the
    entries."""
    outer = getattr(_local, "memo", None)
    if outer is None:
        _local.memo = {}
    try:
        with onnx_model.reusing_exports(), ort_once.sharing():
            yield
    finally:
        if outer is None:
            _local.memo = None


def stats() -> dict:
    """``{"captured": n, "reused": n}`` in the current block (zeros outside one)."""
    memo = getattr(_local, "memo", None) or {}
    return dict(memo.get("_stats", {"captured": 0, "reused": 0}))


def capture_for(model, example_inputs, example_kwargs=None) -> Captured:
    """``capture(model, ...)``, or the block's earlier capture of the same model and inputs."""
    memo = getattr(_local, "memo", None)
    if memo is None or not isinstance(model, torch.nn.Module):
        return capture(model, example_inputs, example_kwargs)
    counts = memo.setdefault("_stats", {"captured": 0, "reused": 0})
    try:
        named = bind_inputs(model, example_inputs, example_kwargs)
        key = fingerprint.fingerprint(model, named, CompileOptions(device="cpu"), {"capture": _values_digest(named)})
    except Exception:  # noqa: BLE001 - a model the fingerprint cannot describe is captured, not reused
        key = None
    if key is None:
        return capture(model, example_inputs, example_kwargs)
    entry = memo.get(key)
    if entry is not None:
        captured, shape = entry
        if _shape(captured) == shape:
            counts["reused"] += 1
            return copy_of(captured)
        del memo[key]           # changed since: never serve it
    captured = capture(model, example_inputs, example_kwargs)
    memo[key] = (captured, _shape(captured))
    counts["captured"] += 1
    return copy_of(captured)


def copy_of(captured: Captured) -> Captured:
    """A compile's own copy: partitioning rewrites the graph it is given in place, so the
    kept capture is never handed out. The weights are shared, not copied (the graph's
    attributes point at the same tensors); that they are unchanged is checked at reuse."""
    gm = captured.graph_module
    graph = copy.deepcopy(gm.graph)
    module = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    module.meta.update(getattr(gm, "meta", {}))
    return dataclasses.replace(captured, graph_module=module, example_inputs=list(captured.example_inputs),
                               eager_outputs=list(captured.eager_outputs), notes=list(captured.notes))


def _values_digest(named: dict) -> str:
    """The example inputs' values: the capture's eager outputs are computed from them."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(named) if isinstance(t, torch.Tensor)]
    scalars = [repr(v) for v in torch.utils._pytree.tree_leaves(named) if not isinstance(v, torch.Tensor)]
    return keys.tensors_digest([(str(i), t) for i, t in enumerate(leaves)]) + "|" + "|".join(scalars)


def _shape(captured: Captured) -> tuple:
    """The kept capture's weights by storage and version, and its example inputs: what a
    compile step that wrote to them in place would change (the kept graph itself is never
    handed out, :func:`copy_of`)."""
    gm = captured.graph_module
    weights = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            weights.append((node.target, id(value)) + ((value.data_ptr(), value._version, tuple(value.shape))
                                                       if isinstance(value, torch.Tensor) else ()))
    return tuple(weights), tuple((id(t), t._version) for t in captured.example_inputs)
