"""ONNX Runtime engine.

A partition is exported with torch's dynamo ONNX exporter, then ONNX Runtime
applies its graph optimisations once at compile time and writes the optimised
model; that optimised model is the blob, so loading skips optimisation.

Which ATen ops are supported is read from the exporter's own registry of ATen
→ ONNX translations, so the analysis report tracks the installed torch.

Loading is made cheap by keeping the weights out of the protobuf: ORT writes
the optimised graph with its initializers as *external data* and, for the
native target, also the weights it has prepacked for its GEMM kernels. At
load ORT maps that data straight from the ``.kiln`` file (the blob is
page-aligned inside it), so a 400 MB model is neither parsed, copied nor
repacked. Prepacked layouts depend on the CPU's kernels and ORT's version;
where either differs from the compiling host, the prepacked entries are
dropped and ORT packs the plain weights itself.

Mapped prepacked weights cost some speed: in paired A/B runs on our 2-core
VM, BERT-base ran 2.5-3 % slower (ResNet-50 ~1 %) than with ORT's own packing
into its heap, which in turn makes a load ~0.15 s slower.
``KILN_ORT_PREPACKED=heap`` chooses the faster inference for long-running
servers; the default, ``map``, the faster load.

The blob's layout is :mod:`kiln.engines.ort_blob`'s.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref

import numpy as np
import torch

from kiln.host import target as target_mod
from kiln.errors import CompilerArgsError
from kiln.engines.base import Engine
from kiln.engines import onnx_model, ort_decomps, ort_decoder, ort_export, ort_fusions, ort_gqa
from kiln.engines.ort_blob import is_packed, pack as _pack, pooled_data, \
    refuse_external as _refuse_external, relocate as _relocate, unpack as _unpack
from kiln import config, scratch

_DATA = "weights.bin"


_registry = onnx_model.registry
EXPORT_OPSET = onnx_model.EXPORT_OPSET


# bfloat16 too: ONNX Runtime's CPU build has no kernel for Add, Mul, MatMul, Conv or the
# reductions in it ("NOT_IMPLEMENTED" at session creation, after the export: 1.7-15 s a
# bf16 training graph, measured 11-28), nor does its Python binding take bf16 inputs
_UNSUPPORTED_DTYPES = {torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16}

# ONNX Runtime's ScatterND with reduction="add" (what torch's exporter writes for an
# accumulating index_put) races between threads where indices repeat: measured on 11-28 with
# ONNX Runtime 1.32 and two threads, index_put 39 and index_add 121 wrong sums in 200 calls,
# a BERT step's token-type embedding gradient (every index 0) 1 in 300; exact with one thread
# (onnxruntime#18048). A check against eager passes such a build most of the time, so these
# run on the host (eager's kernels), unless small enough to be summed as a one-hot product
# (kiln.engines.ort_decomps.sums_by_product), and a build that still holds one is refused.
_ACCUMULATING = {torch.ops.aten.index_put.default: 3, torch.ops.aten.index_put_.default: 3,
                 torch.ops.aten._unsafe_index_put.default: 3, torch.ops.aten.index_add.default: None,
                 torch.ops.aten.embedding_dense_backward.default: None}
WHY_RACES = ("accumulates into repeated indices, which ONNX Runtime's ScatterND computes with a race between "
             "threads (wrong sums now and then)")


def _accumulates(node) -> bool:
    if node.target not in _ACCUMULATING:
        return False
    i = _ACCUMULATING[node.target]
    return i is None or bool(node.args[i] if len(node.args) > i else node.kwargs.get("accumulate", False))


class OnnxRuntimeEngine(Engine):
    # Measured on our CPUs (docs/performance.md): neither ONNX Runtime nor OpenVINO wins
    # everywhere (ResNet-50 39.5 vs 53.2 ms, BERT-base 138.8 vs 113.6 ms); ONNX Runtime
    # covers the most ops, so it leads the default order.
    name = "onnxruntime"
    title = "ONNX Runtime"
    devices = ("cpu",)          # the onnxruntime package kiln depends on is a CPU build
    priority = {"cpu": 10}
    quantizes = ("int8", "int4")   # through ONNX Runtime's quantization tools (below)
    package = "onnxruntime"
    blob_suffix = ".onnx"
    modules = ("onnxruntime", "onnxscript")
    load_modules = ("onnxruntime", "onnx")     # onnxscript is the exporter's: compiling only

    def supports(self, node) -> str | None:
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return self.not_an_op(node)
        if _accumulates(node) and not ort_decomps.sums_by_product(node):
            return WHY_RACES
        kiln_decomposes = target in ort_decomps.TABLE and ort_decomps.decompose_first(node)
        if not _registry().is_registered(target) and not kiln_decomposes \
                and not ort_export.translates_by_decomposition(node, _registry()):
            return "no ONNX translation in torch's exporter registry"
        # inputs too: a bf16 -> float32 cast has a float32 result, but a partition that takes
        # it in takes a bf16 input, which ONNX Runtime cannot run (it then fell to Inductor
        # piece by piece: four C++ builds of a bf16 step where one whole build was due)
        for dtype in self.dtypes(node):
            if dtype in _UNSUPPORTED_DTYPES:
                return f"dtype {dtype} is not supported by ONNX Runtime's CPU kernels"
        return None

    def variants(self, options) -> tuple:
        # "transformers": ORT's transformer fusions (kiln.engines.ort_fusions) first.
        return ("transformers",) if options.target != "generic" and not options.quantize else ()

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        import onnxruntime as ort
        if variant not in (None, "transformers"):
            raise ValueError(f"unknown onnxruntime variant {variant!r}")
        # the exported model, ORT's optimized model and its weights: three copies at most
        with scratch.directory("kiln-ort-", 3 * scratch.tensor_bytes(partition)) as tmp:
            if options.quantize and variant is None:
                model, settings = onnx_model.quantized(partition, example_inputs, options, calibration, tmp)
            else:
                model, settings = onnx_model.exported_file(partition, example_inputs,
                                                           os.path.join(tmp, "model.onnx"))
            if variant == "transformers":
                fused = os.path.join(tmp, "fused.onnx")
                settings.update(variant=variant, **ort_fusions.optimize(model, fused))
                model = fused
            level = _level(options)
            so = ort.SessionOptions()
            so.graph_optimization_level = _ORT_LEVEL[level]
            so.log_severity_level = 3
            so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", _DATA)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                        "1024")
            prepacked = level == "all"     # prepacked layouts are this CPU's, not portable
            if prepacked:
                so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
            ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            with open(so.optimized_model_filepath, "rb") as f:
                graph = f.read()
            graph, fused = _fuse_decoder(graph)
            if fused:
                settings["decoder_fusions"] = fused
            data_path = os.path.join(tmp, _DATA)
            size = os.path.getsize(data_path) if os.path.exists(data_path) else 0
            header = {"graph": len(graph), "data": size, "prepacked": prepacked, "isa": _isa(),
                      "onnxruntime": ort.__version__, **settings}
            return _pack(header, graph, data_file=data_path) if size else _pack(header, graph)

    def quantized_products(self, blob) -> dict | None:
        return header_of(blob).get("products")

    def load(self, blob, runtime_options, origin=None, shared=None):
        import onnxruntime as ort
        so = _session_options(runtime_options)
        if not is_packed(blob):   # an older kiln's plain ONNX blob: its weights inline
            _refuse_external(bytes(blob))
            return OrtRunner(ort.InferenceSession(bytes(blob), so, providers=["CPUExecutionProvider"]))
        header, graph, data_offset = _unpack(blob)
        keep_prepacked = (header["prepacked"] and header["isa"] == _isa()
                          and header["onnxruntime"] == ort.__version__ and _map_prepacked())
        data = memoryview(blob)[data_offset:data_offset + header["data"]]
        if header.get("pool"):      # the weights lie in a member shared with other graphs (ort_pool)
            data, origin, data_offset = pooled_data(header, shared)
        if origin is not None and len(data) and origin.unchanged():
            # ORT maps the data where it lies in the artifact. Should the file be replaced
            # while ORT opens it, ORT may have read the new one: then use a private copy.
            folder, name = os.path.split(origin.path)
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
            try:
                session = ort.InferenceSession(
                    _relocate(graph, name, origin.offset + data_offset, keep_prepacked, _DATA,
                              len(data)), so,
                    providers=["CPUExecutionProvider"])
            except Exception:
                if origin.unchanged():
                    raise
                session = None          # removed meanwhile (a cache eviction): use the copy
            if session is not None and origin.unchanged():
                return OrtRunner(session)
            del session
            so = _session_options(runtime_options)
        # No file to map (a fresh compile, bytes, an object store): write the data to a
        # private file for ORT to map, removed as soon as the session has it.
        tmp = _private_copy(data)
        try:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", tmp)
            session = ort.InferenceSession(_relocate(graph, _DATA, 0, keep_prepacked, _DATA, len(data)), so,
                                           providers=["CPUExecutionProvider"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return OrtRunner(session)


def _fuse_decoder(graph: bytes):
    """The optimised graph with a decoder step's attention block on ORT's fused operators
    (:mod:`kiln.engines.ort_decoder`), and what was fused. A graph with a reducing ScatterND
    (see ``_ACCUMULATING``) is refused here, whatever operator it came from."""
    import onnx
    model = onnx.ModelProto()
    model.ParseFromString(graph)
    for node in model.graph.node:
        if node.op_type == "ScatterND" and any(a.name == "reduction" and a.s not in (b"", b"none")
                                               for a in node.attribute):
            raise RuntimeError(f"the partition exports to ScatterND with reduction: it {WHY_RACES}")
    fused = ort_decoder.fuse(model)
    return (model.SerializeToString(), fused) if fused else (graph, fused)


def _private_copy(data) -> str:
    """A fresh directory holding ``data`` as _DATA: in shared memory where there is room
    (no disk writes of hundreds of MB; :mod:`kiln.scratch`), else in the temp directory."""
    shared = scratch.root_for(len(data))
    for where in ((shared, None) if shared else (None,)):
        tmp = None
        try:
            tmp = tempfile.mkdtemp(prefix="kiln-ort-", dir=where)
            with open(os.path.join(tmp, _DATA), "wb") as f:
                f.write(data)
            return tmp
        except OSError:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if where is None:
                raise
    raise AssertionError("unreachable")


def graph_of(blob):
    """The partition's ONNX graph (weights left external), for inspection and tests."""
    import onnx
    if not is_packed(blob):
        return onnx.load_from_string(bytes(blob))
    return onnx.load_from_string(_unpack(blob)[1])


def header_of(blob) -> dict:
    """The blob's JSON header (what built it: a variant's settings, fused op counts)."""
    if not is_packed(blob):
        return {}
    return _unpack(blob)[0]


def _session_options(runtime_options):
    import onnxruntime as ort
    so = ort.SessionOptions()
    # The blob is already optimised for this target; do not redo the work.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = runtime_options.resolved_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not runtime_options.spin:
        # threads that busy-wait for the next call steal the CPUs from the engines and
        # host operations that run in between (measured: a CNN training step's program
        # 167 -> 37 ms)
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def _map_prepacked() -> bool:
    value = config.get("KILN_ORT_PREPACKED").strip().lower()
    if value not in ("map", "heap"):
        raise CompilerArgsError(f"KILN_ORT_PREPACKED={value!r}: expected 'map' (fast load, the "
                                "default) or 'heap' (ORT packs weights at load: ~2-3 % faster calls)")
    return value == "map"


def _isa() -> list:
    return target_mod.describe("native")["isa"]


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


_ORT_DTYPES = {"tensor(float)": torch.float32, "tensor(double)": torch.float64,
               "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
               "tensor(int64)": torch.int64, "tensor(int32)": torch.int32,
               "tensor(int16)": torch.int16, "tensor(int8)": torch.int8,
               "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool}


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
                 torch.uint8: np.uint8, torch.bool: np.bool_}


class OrtRunner:
    """Calls an ORT session with torch tensors, sharing memory both ways (no copies).

    An output named ``kiln_inplace/<input>`` (:data:`kiln.engines.ort_gqa.INPLACE`) is
    not returned: it is bound to that input's own memory, so the graph updates the input
    in place (a decode step's keys written into the cache it was given). Where the input
    is not one contiguous buffer, a contiguous copy is updated and copied back after the
    call: either way the input is updated (:attr:`in_place`)."""

    def __init__(self, session):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]
        names = [o.name for o in session.get_outputs()]
        self.output_names = [n for n in names if not n.startswith(ort_gqa.INPLACE)]
        self.in_place = [(n, self.input_names.index(n[len(ort_gqa.INPLACE):])) for n in names
                         if n.startswith(ort_gqa.INPLACE) and n[len(ort_gqa.INPLACE):] in self.input_names]
        self._per_thread = threading.local()     # each calling thread's kept binding (_bound_call)
        self._fresh = _static_outputs(session, self.output_names)

    def signature(self):
        """([(shape, dtype)] of the inputs, [(shape, dtype)] of the outputs) as the session
        declares them; None where it declares no static value."""
        def one(arg):
            shape = arg.shape
            static = isinstance(shape, list) and all(isinstance(d, int) for d in shape)
            return (tuple(shape) if static else None), _ORT_DTYPES.get(arg.type)
        return ([one(a) for a in self.session.get_inputs()],
                [one(a) for a in self.session.get_outputs() if a.name in self.output_names])

    def __call__(self, inputs):
        if not self.in_place:
            # Naming the outputs is measurably cheaper per call than passing None.
            feed = dict(zip(self.input_names, (t.numpy() for t in inputs)))
            return [torch.from_numpy(o) for o in self.session.run(self.output_names, feed)]
        mine = self._per_thread
        same = getattr(mine, "same", None)
        # a decode step passes the very tensors of the last step (the scheduler's kept
        # buffers and the cache's views, :meth:`kiln.runtime.kv.KVCache.inputs`): then
        # nothing is bound again, checked by identity, address and shape instead of
        # every input's layout (SmolLM2's 63: ~0.1 ms of a decode step)
        if same is not None and len(same) == len(inputs) and all(
                r() is t and t.data_ptr() == p and t.shape == s for (r, p, s), t in zip(same, inputs)):
            return self._run_bound(mine.binding)
        if not all(inputs[i].is_contiguous() for _, i in self.in_place):
            # an in-place input not in one buffer: the graph updates a contiguous copy, copied
            # back after the call, so the input is updated whichever way the call went (the
            # scheduler relies on it: kiln.runtime.scheduler)
            inputs, back = list(inputs), []
            for _, i in self.in_place:
                if not inputs[i].is_contiguous():
                    back.append((inputs[i], inputs[i].contiguous()))
                    inputs[i] = back[-1][1]
            outs = self._bound_call(inputs)
            for t, copy in back:
                t.copy_(copy)
            return outs
        return self._bound_call(inputs)

    def _bound_call(self, inputs):
        """One call through an IOBinding kept between calls (a decode step: its cache inputs
        and the in-place outputs bound to them are the same buffers at every step).

        Why kept: binding a step's 60-odd cache buffers afresh cost ~0.5 ms of a SmolLM2
        int4 decode step's ~9 ms. Inputs are bound by address, so ORT reads memory changed
        in place since the last call (the cache) as it is now, and the binding holds no
        reference to a caller's tensors (it would keep a dropped cache alive). An input is
        bound again unless it is the same contiguous memory as last time (address, shape,
        strides, dtype); a non-contiguous one is copied for the call and bound every time.
        Outputs are bound afresh each call, or ORT would write the next call's answers into
        memory the caller holds: those of static shape into tensors made for the call, by
        address (reading them back with ``get_outputs`` wraps every bound output, the
        in-place caches included: 0.4-0.5 ms of a SmolLM2 decode step), others allocated by
        ORT. Each thread keeps a binding of its own: two schedulers may call one decode graph
        at once, each with its own cache."""
        mine = self._per_thread
        binding = getattr(mine, "binding", None)
        if binding is None:
            binding = mine.binding = self.session.io_binding()
            mine.inputs, mine.in_place = [None] * len(self.input_names), [None] * len(self.in_place)
        mine.same = None        # set again below once every input is bound where it lies
        bound, bound_in_place, held = mine.inputs, mine.in_place, []
        for k, (name, t) in enumerate(zip(self.input_names, inputs)):
            key = (t.data_ptr(), t.shape, t.stride(), t.dtype) if t.is_contiguous() else None
            if key is None or bound[k] != key:
                if key is None:
                    t = t.contiguous()
                    held.append(t)              # alive until the call is over
                binding.bind_input(name, "cpu", 0, _NUMPY_DTYPES[t.dtype], list(t.shape), t.data_ptr())
                bound[k] = key
        for k, (name, i) in enumerate(self.in_place):
            t = inputs[i]
            key = (t.data_ptr(), t.shape, t.dtype)
            if bound_in_place[k] != key:
                binding.bind_output(name, "cpu", 0, _NUMPY_DTYPES[t.dtype], list(t.shape), t.data_ptr())
                bound_in_place[k] = key
        if not held:           # every input bound where it lies: the next call may find them again
            mine.same = [(weakref.ref(t), t.data_ptr(), t.shape) for t in inputs]
        return self._run_bound(binding)

    def _run_bound(self, binding):
        """Run through ``binding`` (its inputs and in-place outputs bound by :meth:`_bound_call`);
        the other outputs are bound afresh, for the reason its docstring gives."""
        fresh = []
        if self._fresh is not None:
            for name, shape, dtype in self._fresh:
                t = torch.empty(shape, dtype=dtype)
                binding.bind_output(name, "cpu", 0, _NUMPY_DTYPES[dtype], list(shape), t.data_ptr())
                fresh.append(t)
        else:
            for name in self.output_names:
                binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        if self._fresh is not None:
            return fresh
        return [torch.from_numpy(o.numpy()) for o in binding.get_outputs()[:len(self.output_names)]]


def _static_outputs(session, names) -> list | None:
    """``[(name, shape, dtype)]`` of ``names`` when every one has a static, non-empty shape
    and a type bindable by address; else None."""
    declared = {o.name: o for o in session.get_outputs()}
    out = []
    for name in names:
        o = declared[name]
        dtype = _ORT_DTYPES.get(o.type)
        if dtype not in _NUMPY_DTYPES or not isinstance(o.shape, list) \
                or not all(isinstance(d, int) and d > 0 for d in o.shape):
            return None
        out.append((name, tuple(o.shape), dtype))
    return out
