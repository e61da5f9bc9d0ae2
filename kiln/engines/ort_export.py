"""A partition to ONNX through torch's dynamo exporter, without decomposing it twice.

``torch.onnx.export`` re-exports the module it is given (``torch.export``) and then runs
``run_decompositions`` with its registry's table, retracing every node. A kiln partition
is already core ATen, and the ONNX Runtime engine only takes nodes the exporter's registry
translates as they are (:meth:`kiln.engines.onnxruntime.OnnxRuntimeEngine.supports`), so
for it the decomposition pass changes nothing and costs the most: measured on SmolLM2's
30-layer prefill graph (2 cores, under a profiler), 18.4 of 39.7 s of export.

``export`` skips that pass when every operator in the partition is one the registry
translates directly, by standing in for the exporter's ``decompose_with_registry`` for
the length of the call; otherwise (or where the exporter no longer has that function)
it is the plain public call. The stand-in is process-wide, so exports take a lock. What
comes out is checked against eager PyTorch like every compiled partition.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.Lock()


def export(partition, example_inputs, *, opset: int, optimize: bool, registry):
    """``torch.onnx.export(partition, ...)`` (dynamo), an ``ONNXProgram``."""
    with _LOCK, _no_redecomposition(partition, registry):
        return torch.onnx.export(partition, tuple(example_inputs), dynamo=True, opset_version=opset,
                                 optimize=optimize, verbose=False, report=False)


def _translates_directly(partition, registry) -> bool:
    for node in partition.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if not registry.is_registered(node.target):
                return False
    return True


@contextlib.contextmanager
def _no_redecomposition(partition, registry):
    try:
        from torch.onnx._internal.exporter import _fx_passes
    except ImportError:
        _fx_passes = None
    original = getattr(_fx_passes, "decompose_with_registry", None)
    if original is None or not _translates_directly(partition, registry):
        yield
        return
    _fx_passes.decompose_with_registry = _as_is
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original


def _as_is(exported_program, registry):
    return exported_program
