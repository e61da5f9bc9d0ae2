"""A partition to ONNX through torch's dynamo exporter, without decomposing it twice.

``torch.onnx.export`` re-exports the module it is given (``torch.export``) and then runs
``run_decompositions`` with its registry's table, retracing every node. A kiln partition
is already core ATen, and the ONNX Runtime engine only takes nodes the exporter's registry
translates as they are (:meth:`kiln.engines.onnxruntime.OnnxRuntimeEngine.supports`), so
for it the decomposition pass changes nothing and costs the most: measured on SmolLM2's
30-layer prefill graph (2 cores, under a profiler), 18.4 of 39.7 s of export.

It also builds torch's ONNX registry once per opset rather than once per export: the
exporter fills a fresh ``ONNXRegistry`` from onnxscript's torchlib on every call (parsing
the source of some twenty thousand functions), which was 46 of 103 s of compiling a tiny
two-rank decoder's 42 partitions (profiled on the 2-core machine). The registry is only
read during an export that adds no custom translations, as kiln's do not.

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
    with _LOCK, _no_redecomposition(partition, registry), _registry_once():
        return torch.onnx.export(partition, tuple(example_inputs), dynamo=True, opset_version=opset,
                                 optimize=optimize, verbose=False, report=False)


_REGISTRIES: dict = {}     # opset -> the exporter's ONNXRegistry, built once


def registry_for(opset_version=None):
    """torch's ONNX registry for ``opset_version`` (its default when None), built once."""
    from torch.onnx._internal.exporter import _constants, _registration
    version = _constants.TORCHLIB_OPSET if opset_version is None else opset_version
    if version not in _REGISTRIES:
        _REGISTRIES[version] = _ORIGINAL.get("from_torchlib", _registration.ONNXRegistry.from_torchlib.__func__)(
            _registration.ONNXRegistry, opset_version=version)
    return _REGISTRIES[version]


_ORIGINAL: dict = {}


@contextlib.contextmanager
def _registry_once():
    try:
        from torch.onnx._internal.exporter import _registration
        original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    except (ImportError, KeyError):
        yield
        return
    _ORIGINAL.setdefault("from_torchlib", original.__func__)
    _registration.ONNXRegistry.from_torchlib = classmethod(lambda cls, opset_version=None: registry_for(opset_version))
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = original


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
