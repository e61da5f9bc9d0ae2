"""Which torch operators an artifact may name: one rule for the host program
(:mod:`kiln.runtime.program`) and the eager engine's blobs (:mod:`kiln.engines.eager`).

An unsigned artifact is data: its operators must compute on tensors and nothing
else. Refused, at load, with an :class:`~kiln.errors.ArtifactError` naming the op:

* operators outside the namespaces kiln's captures produce: ``aten``, ``prims``,
  ``quantized``, ``quantized_decomposed``, ``kiln`` and a library's own namespace (a
  user's custom operator, registered by importing it), so not torch's internal ones
  (``prim``, ``debugprims``, ``profiler``, ``c10d``, ``symm_mem``, any ``_name``, ...);
* operators that touch files, storages or raw memory, in any namespace: a schema
  argument of type ``Storage`` (``aten::set_.source_Storage``), a ``str`` argument
  whose name says file, path or dir (``aten::from_file``, ``aten::save``), and the
  operators in ``_REFUSED``.

It lives in the engines layer, the lowest both users sit above (runtime imports engines,
never the other way: pyproject.toml's import-linter contract).
"""
from __future__ import annotations

import torch

# what kiln's own captures write into programs and eager blobs
CORE = frozenset({"aten", "prims", "quantized", "quantized_decomposed", "kiln"})
# torch's own namespaces of operators that are not tensor computations (TorchScript's
# interpreter, debugging, profiling, process groups, shared memory, test and export helpers)
_INTERNAL = frozenset({
    "prim", "debugprims", "rngprims", "profiler", "c10d", "symm_mem", "static_runtime",
    "onednn", "mkldnn", "mkldnn_prepacked", "mkl", "sparse", "inductor", "inductor_prims",
    "onnx", "quantization", "export", "debug_mode_ops", "higher_order", "fbgemm", "xnnpack",
    "streams", "cuda", "torch"})
# by name, whatever their schema says
_REFUSED = frozenset({"aten::from_file", "aten::_from_file", "aten::save", "aten::load",
                      "aten::set_", "aten::set"})
_FILE_WORDS = ("file", "path", "dir")


def refusal(op) -> str | None:
    """Why ``op`` (an OpOverload) may not be run from an artifact, or None."""
    schema = op._schema
    ns = schema.name.partition("::")[0]
    if ns not in CORE and (ns in _INTERNAL or ns.startswith("_")):
        return (f"torch's internal namespace {ns!r} is not one kiln's captures use (aten, prims, "
                "quantized, kiln, or a custom operator's library)")
    if schema.name in _REFUSED:
        if schema.name.endswith(("set_", "::set")) and not _takes_storage(schema):
            return None         # set_ from another tensor: a view, no foreign memory
        return "it reads or writes files, storages or raw memory"
    if _takes_storage(schema):
        return "it takes a Storage (raw memory) argument"
    for a in schema.arguments:
        if "str" in str(a.type) and any(w in a.name.lower() for w in _FILE_WORDS):
            return f"its {a.name!r} argument names a file"
    return None


def _takes_storage(schema) -> bool:
    return any("Storage" in str(a.type) for a in schema.arguments)


def check(op, where: str, what: str = ""):
    """``op``, or an ArtifactError naming it (``what``, as the artifact spelled it) and
    ``where`` it was found if it is not a torch operator or is refused."""
    from kiln.errors import ArtifactError
    if not isinstance(op, torch._ops.OpOverload):     # attribute lookup reaches other objects
        raise ArtifactError(f"{where} names {what or op!r}, which is not a torch operator; the "
                            "artifact is corrupt or was edited")
    reason = refusal(op)
    if reason is not None:
        name = f"{op._schema.name}.{op._overloadname}"
        raise ArtifactError(f"{where} calls {name}, which an artifact may not run ({reason})")
    return op

