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

from ..quiet import EXPORTER_LOGGERS, quiet
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
    modules = ("onnxruntime", "onnxscript")

    def supports(self, node) -> str | None:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return self.not_an_op(node)
        if not _registry().is_registered(target):
            return "no ONNX translation in torch's exporter registry"
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.dtype in _UNSUPPORTED_DTYPES:
                return f"dtype {v.dtype} is not supported by ONNX Runtime's CPU kernels"
        return None

    def compile(self, partition, example_inputs, options, calibration=None) -> bytes:
        import onnxruntime as ort
        with torch.no_grad(), quiet():
            program = torch.onnx.export(partition, tuple(example_inputs), dynamo=True,
                                        optimize=True, verbose=False, report=False)
        with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
            model = os.path.join(tmp, "model.onnx")
            program.save(model)
            if options.quantize:
                model = _quantize(model, tmp, options, calibration or [list(example_inputs)])
            so = ort.SessionOptions()
            so.graph_optimization_level = _ORT_LEVEL[_level(options)]
            so.log_severity_level = 3
            so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
            ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            with open(so.optimized_model_filepath, "rb") as f:
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


def _quantize(model: str, tmp: str, options, calibration) -> str:
    """int8 through ONNX Runtime's own quantization tools.

    dynamic: weights to int8 ahead of time, activations quantized per call (no data).
    static: weights and activations int8 (QDQ) with ranges calibrated on ``calibration``,
    a list of partition input lists.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    prepared, out = os.path.join(tmp, "prepared.onnx"), os.path.join(tmp, "int8.onnx")
    with quiet(EXPORTER_LOGGERS + ("root",)):
        quant_pre_process(model, prepared, skip_symbolic_shape=True)
        nodes = _weight_nodes(prepared)
        if options.quantize_mode == "dynamic":
            nodes = _gemm_to_matmul(prepared, nodes)
            quantize_dynamic(prepared, out, weight_type=QuantType.QInt8, per_channel=True,
                             nodes_to_quantize=nodes)
        else:
            quantize_static(prepared, out, _Calibration(prepared, calibration),
                            quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_quantize=nodes)
    return out


def _weight_nodes(path: str) -> list:
    """MatMul/Gemm/Conv nodes whose weight is a constant: the ones int8 pays off for.

    Products of two activations (attention scores) stay in fp32: quantizing them
    costs accuracy for little speed.
    """
    import onnx
    graph = onnx.load(path).graph
    rank = {i.name: len(i.dims) for i in graph.initializer}

    def weight(n):
        r = rank.get(n.input[1]) if len(n.input) > 1 else None
        # per-channel int8 needs a plain [K, N] matrix (or a conv kernel)
        return r is not None and (r == 2 or n.op_type == "Conv")

    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm", "Conv") and weight(n)]


def _gemm_to_matmul(path: str, nodes: list) -> list:
    """Rewrite plain weight Gemms as MatMul + Add, in place; return the new node names.

    ORT's dynamic quantizer handles MatMul but not Gemm, and torch's exporter
    emits Gemm for every linear layer.
    """
    import onnx
    from onnx import helper, numpy_helper
    model = onnx.load(path)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    wanted, renamed, new_nodes = set(nodes), [], []
    for n in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        plain = (attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
                 and not attrs.get("transA", 0))
        if n.op_type != "Gemm" or n.name not in wanted or not plain:
            new_nodes.append(n)
            if n.name in wanted:
                renamed.append(n.name)
            continue
        weight = n.input[1]
        if attrs.get("transB", 0):
            w = inits[weight]
            t = numpy_helper.to_array(w).T.copy()
            weight = f"{w.name}__kiln_t"
            graph.initializer.append(numpy_helper.from_array(t, weight))
        mm_out = n.output[0] if len(n.input) < 3 else f"{n.output[0]}__kiln_mm"
        new_nodes.append(helper.make_node("MatMul", [n.input[0], weight], [mm_out], name=n.name))
        if len(n.input) >= 3:
            new_nodes.append(helper.make_node("Add", [mm_out, n.input[2]], [n.output[0]],
                                              name=f"{n.name}__kiln_bias"))
        renamed.append(n.name)
    del graph.node[:]
    graph.node.extend(new_nodes)
    onnx.save(model, path)
    return renamed


class _Calibration:
    """ORT CalibrationDataReader over kiln's per-partition calibration inputs."""

    def __init__(self, model_path, samples):
        import onnx
        names = [i.name for i in onnx.load(model_path, load_external_data=False).graph.input]
        self._feeds = iter([{n: t.numpy() for n, t in zip(names, sample)} for sample in samples])

    def get_next(self):
        return next(self._feeds, None)

    def rewind(self):
        pass


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
