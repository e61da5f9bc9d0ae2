"""ONNX Runtime engine.

A partition is exported with torch's dynamo ONNX exporter, then ONNX Runtime
applies its graph optimisations once at compile time and writes the optimised
model; that optimised model is the blob, so loading skips optimisation.

Which ATen ops are supported is read from the exporter's own registry of ATen
→ ONNX translations, so the analysis report tracks the installed torch.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile

import torch

from ..quiet import quiet
from . import Backend


@functools.lru_cache(maxsize=1)
def _registry():
    # torchvision ops are optional in the registry; its absence is not news.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    from torch.onnx._internal.exporter import _registration
    return _registration.ONNXRegistry.from_torchlib()


_UNSUPPORTED_DTYPES = {torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2}


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    blob_suffix = ".onnx"

    def available(self) -> bool:
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError:
            return False
        return True

    def version(self) -> str:
        import onnxruntime
        return onnxruntime.__version__

    def supports(self, node) -> str | None:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return None if node.target.__name__ == "getitem" else f"{target} is not an ATen operator"
        if not _registry().is_registered(target):
            return "no ONNX translation in torch's exporter registry"
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.dtype in _UNSUPPORTED_DTYPES:
                return f"dtype {v.dtype} is not supported by ONNX Runtime's CPU kernels"
        return None

    def compile(self, partition, example_inputs, options) -> bytes:
        import onnxruntime as ort
        with torch.no_grad(), quiet():
            program = torch.onnx.export(partition, tuple(example_inputs), dynamo=True,
                                        optimize=True, verbose=False, report=False)
        proto = program.model_proto
        raw = proto.SerializeToString()
        so = ort.SessionOptions()
        so.graph_optimization_level = _ORT_LEVEL[_level(options)]
        so.log_severity_level = 3
        with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
            path = os.path.join(tmp, "optimized.onnx")
            so.optimized_model_filepath = path
            ort.InferenceSession(raw, so, providers=["CPUExecutionProvider"])
            with open(path, "rb") as f:
                return f.read()

    def load(self, blob: bytes, runtime_options):
        import onnxruntime as ort
        so = ort.SessionOptions()
        # The blob is already optimised for this target; do not redo the work.
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = runtime_options.resolved_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        session = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
        return OrtRunner(session)


def _level(options) -> str:
    if options.target == "generic":
        return "extended"          # no CPU-specific layouts
    return "basic" if options.optlevel <= 1 else "all"


def _ort_levels():
    import onnxruntime as ort
    L = ort.GraphOptimizationLevel
    return {"basic": L.ORT_ENABLE_BASIC, "extended": L.ORT_ENABLE_EXTENDED, "all": L.ORT_ENABLE_ALL}


class _Levels(dict):
    def __missing__(self, key):
        self.update(_ort_levels())
        return self[key]


_ORT_LEVEL = _Levels()


class OrtRunner:
    """Calls an ORT session with torch tensors, sharing memory both ways (no copies)."""

    def __init__(self, session):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]

    def __call__(self, inputs):
        feed = {name: t.numpy() for name, t in zip(self.input_names, inputs)}
        # Naming the outputs is measurably cheaper per call than passing None.
        return [torch.from_numpy(o) for o in self.session.run(self.output_names, feed)]
