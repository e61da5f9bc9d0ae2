"""Engines that turn a device partition into executable code, and their registry.

Every engine implements one contract, ``kiln.engines.Engine`` (``base.py``):
it describes itself (name, devices, default-order priority, quantize modes,
natively computed types, package and version, whether its blobs are native
code) and does three things: ``supports(node)`` says whether it can run an fx
node (or why not), ``compile(partition, example_inputs, options, *,
variant=None, calibration=None)`` makes a self-contained blob, and
``load(blob, runtime_options, origin=None)`` makes a thread-safe callable of
it. Selection (``kiln.compiler.selection``) reads only these attributes, so a
new engine is one file here plus a line in ``registry.BUILTIN``, or a package
of its own that names its ``Engine`` under the ``kiln.engines`` entry-point
group.

Engines: ``onnxruntime`` and ``openvino`` (CPU, blobs are data),
``inductor`` (CPU and CUDA, blobs are native code) and ``eager`` (the
partition run by PyTorch itself, the reference; chosen only when named).

Importing this package imports no engine: each is imported when first asked for.
"""
from kiln.engines.base import Engine
from kiln.engines.registry import (ENTRY_POINT_GROUP, available, describe, get, names, native_code,
                                   native_engine, ranked, register, registered, runs_on, unregister,
                                   versions)

__all__ = ["Engine", "ENTRY_POINT_GROUP", "available", "describe", "get", "names",
           "native_code", "native_engine", "ranked", "register", "registered", "runs_on",
           "unregister", "versions"]
