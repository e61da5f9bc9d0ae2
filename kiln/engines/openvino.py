"""OpenVINO engine.

A partition (already core ATen, weights inside) goes straight to OpenVINO's
PyTorch frontend, which converts it with static shapes; the CPU plugin then
compiles it for this machine once, at compile time, and the compiled model it
exports is the blob, so loading skips conversion and compilation.
``--target generic`` stores the converted model (OpenVINO IR) instead:
compiled blobs are tied to the instruction set they were built for, so a
portable artifact has to compile where it loads.

Numbers are the user's choice, not OpenVINO's: the inference precision is
pinned (f32, or bf16/f16 only for a native ``--auto-cast``), since left alone
OpenVINO picks bf16 on CPUs that have it. The CPU plugin also silently computes
int64 in int32 and float64 in float32; so float64 ops stay on the host, int64 ops
stay only where their values provably fit int32, and int64 inputs are
range-checked on every call. bf16/fp16 ops it computes in float32 at that pinned
precision, held to eager at the type's floor (:mod:`kiln.engines.ov_dtypes`);
bf16 tensors cross the boundary as their bits, NumPy having no bfloat16.

Which ATen ops are supported is read from OpenVINO's own table for its PyTorch
frontend, so the analysis report tracks the installed OpenVINO.

Weight-only quantized partitions (int8, int4, a GGUF file's blocks) take another road: the
ONNX model ONNX Runtime's engine quantizes (:mod:`kiln.engines.onnx_model`: the same
``MatMulNBits`` blocks, bit for bit; in a bf16/f16 build a block's float minimum becomes
a float zero point, :mod:`kiln.engines.ov_zero_points`) is read by OpenVINO's ONNX
frontend, which keeps the blocks as compressed weights, and the CPU plugin multiplies them with each group of 32
activations quantized to int8 on the fly, as ONNX Runtime's kernels do
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``). On SmolLM2-135M's 128-token int4 prefill graph that
took about half ONNX Runtime's time, with logits closer to float32's (docs/performance.md);
on its one-token decode step it was slower, so which engine runs which graph is measured
(:func:`kiln.compiler.selection.times_quantizers`).

Blob layout: ``b"KILNOV1\\0"``, a little-endian uint32 header length, a JSON
header (``kind``: ``compiled`` or ``ir``; ``openvino``: its version;
``precision``; ``inputs`` and ``outputs``: counts; ``xml``: the size of the IR's
XML part), then the payload: the compiled model, or the IR's XML then weights.
"""
from __future__ import annotations

import functools
import json
import os
import struct
import threading

import numpy as np
import torch

from kiln import scratch
from kiln.errors import ArtifactError, InputError
from kiln.quiet import EXPORTER_LOGGERS, quiet
from kiln.engines import ov_dtypes, ov_export, ov_graph, ov_zero_points
from kiln.engines.base import Engine
from kiln.host import target as host_target

_MAGIC = b"KILNOV1\0"
_LOGGERS = EXPORTER_LOGGERS + ("openvino", "torch.fx")
_INT32 = ov_dtypes.INT32
# Ops capture leaves that OpenVINO's op table does not list but its FX frontend converts
# (whole SDPA, kiln.graph.capture.KEEP_WHOLE, and the reshapes of its output; as a view):
# see kiln.engines.ov_graph.
_CONVERTED = {torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.reshape.default}


@functools.lru_cache(maxsize=1)
def _op_table():
    from openvino.frontend.pytorch.torchdynamo.op_support import OperatorSupport
    return OperatorSupport(None)


@functools.lru_cache(maxsize=1)
def _core():
    import openvino as ov
    return ov.Core()


def _config(precision: str, **extra) -> dict:
    # Spelled out so that a new OpenVINO default cannot change kiln's numbers.
    return {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": "1", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", **extra}


# A quantized partition's activations are quantized to int8 in groups of this many along
# the input dim inside each product, as ONNX Runtime's MatMulNBits does at accuracy level 4
# (kiln.engines.ort_quantize.ACCURACY_LEVEL) with the same 32-wide blocks. At 0 (float
# activations) the prefill step was slower than ONNX Runtime's.
QUANTIZED_GROUP = 32


# Folding a product's offsets into float zero points must be this much faster to be chosen:
# the folded form has half the operations and lands closer to float64 (ov_zero_points).
FOLD_MARGIN = 0.95


def _fold_pays(precision: str, shapes: list) -> dict:
    """Whether this CPU runs ``shapes``' products with float zero points (folded) faster
    than as kiln's pair of products, timed on :func:`ov_zero_points.probe`'s models compiled
    as the partition will be (1.8-2.1 s for SmolLM2's prefill shapes, idle; once per
    process and shapes). A probe that fails does not fail the build: the products fold, as
    they did before the probe, and the header says why."""
    try:
        return dict(_fold_timing(precision, tuple(shapes)))
    except Exception as e:                   # a measurement, never a reason to refuse a build
        return {"fold": True, "probe_failed": f"{type(e).__name__}: {e}"[:300]}


@functools.lru_cache(maxsize=16)
def _fold_timing(precision: str, shapes: tuple) -> tuple:
    import time
    import onnx
    rng = np.random.default_rng(0)
    requests = {}
    with scratch.directory("kiln-ov-probe-") as tmp:
        for name, model in zip(("pair", "folded"), ov_zero_points.probe(list(shapes))):
            path = os.path.join(tmp, name + ".onnx")
            onnx.save(model, path)
            with quiet(_LOGGERS):
                compiled = _core().compile_model(_core().read_model(path), "CPU",
                                                 _config(precision, DYNAMIC_QUANTIZATION_GROUP_SIZE=str(QUANTIZED_GROUP)))
            request = requests[name] = compiled.create_infer_request()
            for i, port in enumerate(compiled.inputs):
                request.set_input_tensor(i, _tensor_like(port, rng))
    times = {name: [] for name in requests}
    for round_ in range(18):                 # interleaved; the first three warm up
        for name, request in requests.items():
            start = time.perf_counter()
            request.infer()
            if round_ >= 3:
                times[name].append(time.perf_counter() - start)
    fold_ms, pair_ms = (1e3 * float(np.median(times[k])) for k in ("folded", "pair"))
    return (("fold", fold_ms <= pair_ms / FOLD_MARGIN), ("fold_ms", round(fold_ms, 3)), ("pair_ms", round(pair_ms, 3)))


def _tensor_like(port, rng):
    import openvino as ov
    shape = [d.get_length() for d in port.get_partial_shape()]
    return ov.Tensor(rng.standard_normal(shape).astype(np.float32))


def _header_config(header: dict, **extra) -> dict:
    group = header.get("dynamic_quantization_group_size", 0)
    return _config(header["precision"], DYNAMIC_QUANTIZATION_GROUP_SIZE=str(group), **extra)


class OpenVinoEngine(Engine):
    name = "openvino"
    title = "OpenVINO"
    devices = ("cpu",)          # the openvino package kiln uses runs its CPU plugin only
    priority = {"cpu": 20}
    # Measured: partitions with attention (a softmax) run faster here. all-MiniLM-L6-v2
    # ran 38 ms on OpenVINO against 58 on ONNX Runtime (0.75x eager), BERT-base 110-133
    # against 131-149 ms; so -O2 sends them to OpenVINO first.
    prefers_attention = True
    package = "openvino"
    blob_suffix = ".ovblob"
    modules = ("openvino",)
    # weight-only only: ONNX Runtime's int8 dynamic/static models are its own QDQ operators
    quantizes = ("int8", "int4")
    quantize_modes = ("weight_only",)

    def version(self) -> str:
        # The build string (2026.4.1-22982-...): compiled blobs load only in that build.
        import openvino
        return openvino.__version__

    def native_types(self, device: str = "cpu") -> tuple:
        # The CPU plugin computes bf16/f16 where the CPU does; kiln pins f32 elsewhere.
        return tuple(t for t in ("bf16", "fp16") if device == "cpu" and host_target.native(t))

    def supports(self, node) -> str | None:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return self.not_an_op(node)
        if target not in _CONVERTED and not _op_table().is_node_supported({}, node):
            return "not in OpenVINO's PyTorch frontend op table"
        return ov_dtypes.reason(node)

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        if variant is not None:
            raise ValueError(f"unknown openvino variant {variant!r}")
        if options.quantize:
            return self._compile_quantized(partition, example_inputs, options, calibration)
        # Another engine's rules may have drawn this partition (-O3 tries every engine):
        # refuse ops whose results OpenVINO would change rather than compile them.
        for node in partition.graph.nodes:
            reason = node.op == "call_function" and self.supports(node)
            if reason:
                raise RuntimeError(f"{node.target} cannot run on OpenVINO: {reason}")
        model = _convert(partition, example_inputs)
        _check_io(model, partition, example_inputs)
        header = {"kind": "ir" if options.target == "generic" else "compiled",
                  "openvino": self.version(), "precision": _precision(options),
                  "inputs": len(model.inputs), "outputs": len(model.outputs)}
        # auto-cast to a type computed natively is lossy: held loosely against eager (above)
        return self._blob(model, header, example_inputs if header["precision"] != "f32" else None)

    def _compile_quantized(self, partition, example_inputs, options, calibration) -> bytes:
        from kiln.engines import onnx_model
        if options.quantize_mode != "weight_only":
            raise RuntimeError(f"OpenVINO runs weight-only quantized partitions only, not "
                               f"quantize_mode={options.quantize_mode!r}")
        # through ONNX too, the CPU plugin computes int64 in int32: the same dtype rules apply
        for node in partition.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                reason = ov_dtypes.reason(node)
                if reason:
                    raise RuntimeError(f"{node.target} cannot run on OpenVINO: {reason}")
        with scratch.directory("kiln-ov-", 2 * scratch.tensor_bytes(partition)) as tmp:
            # products left apart: joined (query/key/value, gate/up: ONNX Runtime's fewer nodes),
            # OpenVINO split each joined product's output with a reference kernel and layout
            # reorders around it; SmolLM2's int8 128-token prefill in bf16 took 98.9 ms joined,
            # 79.5 ms apart (medians of 20 alternating calls, 2 cores)
            path, settings = onnx_model.quantized(partition, example_inputs, options, calibration, tmp,
                                                  merge=False)
            if settings.get("exporter_optimized"):      # a small graph: the exporter's fused ops
                settings["rotary_decomposed"] = _decompose_rotary(path)
            # blocks with a float minimum: one product with float zero points where OpenVINO
            # computes in bf16/f16 (in f32 it then skips its int8 activations: slower) and
            # this CPU runs the folded product faster (measured, ov_zero_points)
            if _precision(options) != "f32":
                zero_points = ov_zero_points.fold_file(path, functools.partial(_fold_pays, _precision(options)))
                settings["zero_points_folded"] = zero_points.pop("folded")
                if zero_points:
                    settings["zero_point_timing"] = zero_points
            with quiet(_LOGGERS):
                model = _core().read_model(path)
            _check_io(model, partition, example_inputs)
            header = {"kind": "ir" if options.target == "generic" else "compiled",
                      "openvino": self.version(), "precision": _precision(options), "inputs": len(model.inputs),
                      "outputs": len(model.outputs), "quantized": options.quantize,
                      "dynamic_quantization_group_size": QUANTIZED_GROUP, "onnx": settings}
            return self._blob(model, header, example_inputs)

    def _blob(self, model, header, round_trip_inputs=None) -> bytes:
        """The blob; with ``round_trip_inputs`` (lossy builds), the compiled model's export is
        checked to answer as the compiled model does (:mod:`kiln.engines.ov_export`)."""
        if header["kind"] == "ir":
            xml, weights = _serialize(model)
            header["xml"] = len(xml)
            return _pack(header) + xml + weights
        core, config = _core(), _header_config(header)
        with quiet(_LOGGERS):
            compiled = core.compile_model(model, "CPU", config)
            exported = ov_export.export(compiled)
            if round_trip_inputs is not None:
                ov_export.check_round_trip(core, compiled, exported, config, round_trip_inputs, OvRunner)
        return _pack(header) + exported

    def quantized_products(self, blob) -> dict | None:
        return _unpack(blob)[0].get("onnx", {}).get("products")

    def load(self, blob, runtime_options, origin=None, shared=None):
        import openvino as ov
        header, payload = _unpack(blob)
        config = _header_config(header, INFERENCE_NUM_THREADS=str(runtime_options.resolved_threads()))
        core = _core()
        mapped = None
        if header["kind"] == "ir":
            xml = bytes(payload[:header["xml"]])
            weights = ov.Tensor(np.frombuffer(payload[header["xml"]:], dtype=np.uint8))
            compiled = core.compile_model(core.read_model(xml, weights), "CPU", config)
        else:
            if header["openvino"] != self.version():
                raise ArtifactError(
                    f"an OpenVINO partition was compiled by OpenVINO {header['openvino']}, this is "
                    f"{self.version()}; compiled OpenVINO models load only in the version that "
                    "made them: recompile, or compile with --target generic")
            # OpenVINO keeps weights where they lie when it may share the memory it imports
            # from, which must be writable: a private copy-on-write mapping of the artifact's
            # pages (SmolLM2 fp32, three graphs: load 2.8-4.7 -> 2.0 s, heap 3.7 -> 2.0 GB)
            mapped = origin.map_private(len(blob)) if origin is not None else None
            if mapped is not None:
                start = len(blob) - len(payload)
                tensor = ov.Tensor(np.frombuffer(mapped, dtype=np.uint8, offset=start), shared_memory=True)
            else:   # no file (a fresh compile, bytes): one copy, into a tensor OpenVINO owns
                tensor = ov.Tensor(np.frombuffer(payload, dtype=np.uint8))
            try:
                compiled = core.import_model(tensor, "CPU", config)
            except RuntimeError as e:
                if "runtime_requirements" not in str(e):
                    raise
                raise ArtifactError(
                    "this OpenVINO partition was compiled for another CPU (OpenVINO's CPU plugin found "
                    "its instruction set or precision incompatible with this one's); compiled OpenVINO "
                    "models load only on CPUs like the one that made them: recompile here, or compile "
                    "with --target generic") from None
        if (len(compiled.inputs), len(compiled.outputs)) != (header["inputs"], header["outputs"]):
            raise ArtifactError("OpenVINO blob does not match its header "
                                f"({len(compiled.inputs)} inputs, {len(compiled.outputs)} outputs)")
        return OvRunner(compiled, mapped)


# -- op support -------------------------------------------------------------------

def _precision(options) -> str:
    """f32 unless --auto-cast asks for a type this CPU computes natively (else kiln emulates it)."""
    cast_type = getattr(options, "auto_cast_type", "fp32")
    if getattr(options, "auto_cast", "none") != "none" and cast_type in ("bf16", "fp16") \
            and host_target.native(cast_type):
        return {"bf16": "bf16", "fp16": "f16"}[cast_type]
    return "f32"


# -- compile --------------------------------------------------------------------

def _decompose_rotary(path: str) -> int:
    """:func:`kiln.engines.ov_export.decompose_rotary` on the ONNX file at ``path`` (a small
    graph's: only the exporter's optimiser writes the op), saved back when it changed."""
    import onnx
    model = onnx.load(path)
    count = ov_export.decompose_rotary(model)
    if count:
        onnx.save(model, path)
    return count


def _convert(partition, example_inputs):
    """GraphModule → OpenVINO model with static input shapes and types, in positional order.

    The frontend's FX decoder reads the graph as it is, called directly as OpenVINO's own
    torch.compile backend calls it; converting via torch.export would trace and decompose
    the partition twice more for nothing. ``ov.convert_model`` around the same frontend adds
    argument handling, a preprocessing build (a pass over the whole model) and the offline
    MOC transformations, which the CPU plugin's compile does again: per SmolLM2 decode
    graph (3,192 nodes) 3.3-4.3 s against 1.5-2.0 s, BERT-base 1.6-1.7 s against 0.2 s, with
    the same compile time, speed and answers (measured 11-28, 2 cores).
    """
    import openvino as ov
    from openvino.frontend import FrontEndManager
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder
    partition = ov_graph.prepared(partition)
    with torch.no_grad(), quiet(_LOGGERS):
        decoder = TorchFXPythonDecoder(partition)   # held here: the frontend keeps no reference to it
        frontend = FrontEndManager().load_by_framework("pytorch")
        model = frontend.convert(frontend.load(decoder))
        if len(model.inputs) == len(example_inputs):     # else _check_io says what differs
            for port, t in zip(model.inputs, example_inputs):
                node = port.get_node()
                node.set_element_type(_ov_type(t.dtype))
                node.set_partial_shape(ov.PartialShape(list(t.shape)))
            model.validate_nodes_and_infer_types()
    return model


def _check_io(model, partition, example_inputs):
    """OpenVINO must see the partition's inputs and outputs in the partition's order."""
    for kind, ports, tensors in (("inputs", model.inputs, example_inputs),
                                 ("outputs", model.outputs, _outputs(partition, example_inputs))):
        got = [(tuple(p.get_partial_shape().to_shape()), p.get_element_type().get_type_name()) for p in ports]
        want = [(tuple(t.shape), _ov_type(t.dtype).get_type_name()) for t in tensors]
        if got != want:
            raise RuntimeError(f"OpenVINO's model {kind} {got} do not match the partition's {want}")


def _outputs(partition, example_inputs) -> list:
    """The partition's flat outputs: their recorded metadata, or a run where that is missing."""
    out = next(n for n in partition.graph.nodes if n.op == "output").args[0]
    nodes = list(out) if isinstance(out, (tuple, list)) else [out]
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]
    if all(isinstance(v, torch.Tensor) for v in vals):
        return vals
    with torch.no_grad():
        res = partition(*example_inputs)
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _ov_type(dtype):
    import openvino as ov
    if dtype == torch.bfloat16:         # NumPy has none; crosses as int16 bits (OvRunner)
        return ov.Type.bf16
    if dtype == torch.bool:
        return ov.Type.boolean
    return ov.Type(torch.empty((), dtype=dtype).numpy().dtype)


def _serialize(model) -> tuple[bytes, bytes]:
    import openvino as ov
    size = sum(op.get_byte_size() for op in model.get_ops() if op.get_type_name() == "Constant")
    with scratch.directory("kiln-ov-", size) as tmp:
        xml, weights = os.path.join(tmp, "model.xml"), os.path.join(tmp, "model.bin")
        ov.save_model(model, xml, compress_to_fp16=False)
        with open(xml, "rb") as f, open(weights, "rb") as g:
            return f.read(), g.read()


# -- blob -----------------------------------------------------------------------

def _pack(header: dict) -> bytes:
    raw = json.dumps(header, sort_keys=True).encode()
    return _MAGIC + struct.pack("<I", len(raw)) + raw


def _unpack(blob) -> tuple[dict, memoryview]:
    view = memoryview(blob)
    start = len(_MAGIC) + 4
    if len(view) < start or bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise ArtifactError("not a kiln OpenVINO blob (bad magic)")
    (size,) = struct.unpack("<I", view[len(_MAGIC):start])
    try:
        header = json.loads(bytes(view[start:start + size]))
    except ValueError as e:
        raise ArtifactError(f"kiln OpenVINO blob has a corrupt header: {e}") from None
    return header, view[start + size:]


# -- run ------------------------------------------------------------------------

class OvRunner:
    """Calls an OpenVINO compiled model with torch tensors, one infer request per thread.

    Inputs are shared with OpenVINO (no copies). Outputs are copied out of the
    request: a request reuses its output buffers on its next call, so handing
    out views would let a later call overwrite an earlier result. Tensors are
    set one by one: ``InferRequest.infer(inputs)`` costs ~200 µs more per call
    in Python-side dispatch.
    """

    def __init__(self, compiled, mapping=None):
        import openvino as ov
        self.compiled = compiled
        self._mapping = mapping     # the artifact's pages OpenVINO reads the weights from
        self._tensor = ov.Tensor
        self._num_outputs = len(compiled.outputs)
        self._int64 = [i for i, p in enumerate(compiled.inputs) if p.get_element_type() == ov.Type.i64]
        # bf16 crosses as its bits: NumPy has no bfloat16 (OpenVINO shows them as float16)
        self._bf16_in = {i for i, p in enumerate(compiled.inputs) if p.get_element_type() == ov.Type.bf16}
        self._bf16_out = {i for i, p in enumerate(compiled.outputs) if p.get_element_type() == ov.Type.bf16}
        self._bf16 = ov.Type.bf16
        self._local = threading.local()

    def _request(self):
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        return req

    def _check_int64(self, inputs):
        for i in self._int64:
            t = inputs[i]
            if t.numel():
                lo, hi = (v.item() for v in torch.aminmax(t))
                if lo < _INT32[0] or hi > _INT32[1]:
                    raise InputError(
                        f"an int64 input holds values outside int32 ({lo}..{hi}); OpenVINO's CPU "
                        "plugin computes int64 in int32, so the result would be wrong. Compile "
                        "with another engine (engine='onnxruntime') for such inputs")

    def signature(self):
        """Input and output counts (shapes and types: OpenVINO may declare its own)."""
        return [(None, None)] * len(self.compiled.inputs), [(None, None)] * self._num_outputs

    def __call__(self, inputs):
        if self._int64:
            self._check_int64(inputs)
        req = self._request()
        # The request shares these arrays' memory without keeping them alive: a contiguous
        # copy of a strided input must be held until the inference is over, or its memory
        # is freed and reused while OpenVINO reads it (wrong answers for views).
        arrays = [t.detach().contiguous().view(torch.int16).numpy() if i in self._bf16_in
                  else t.detach().contiguous().numpy() for i, t in enumerate(inputs)]
        for i, a in enumerate(arrays):
            req.set_input_tensor(i, self._tensor(a, list(a.shape), self._bf16) if i in self._bf16_in
                                 else self._tensor(a, shared_memory=True))
        req.infer()
        outs = [self._output(req, i) for i in range(self._num_outputs)]
        del arrays      # (only now)
        return outs

    def _output(self, req, i):
        data = req.get_output_tensor(i).data
        if i in self._bf16_out:
            return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(data.copy())
