"""The compiler's phases, and the typed objects handed from one to the next::

    model ──capture──► Captured ──plan──► Plan ──build──► Build ──package──► Artifact
                          ▲                                                     │
    FX graph ─from_graph──┘                       load (runtime) ◄──────────────┘ ──check──► validation

A caller may enter at any arrow: ``kiln.trace`` starts from a model; a
``torch.compile`` backend or a lazy device's ``mark_step`` starts from an FX graph
(:func:`kiln.graph.capture.from_graph` gives the ``Captured``); the parallel-compile
worker starts from a ``Captured`` it read from disk. Each phase takes the options
already parsed (:class:`kiln.compiler.options.CompileOptions`, frozen) and returns a
new object instead of changing its input, so a phase can be rerun or skipped.
"""
from __future__ import annotations

import dataclasses
import datetime
import warnings
from dataclasses import dataclass, field

import torch

from kiln import engines
from kiln._version import __version__
from kiln.artifact import specs
from kiln.artifact.container import FORMAT, FORMAT_VERSION, Artifact
from kiln.engines.base import Engine
from kiln.errors import CompilerArgsError, UnsupportedOpError
from kiln.graph import dropout, index_ranges, randomness
from kiln.graph.analysis import AnalysisReport, report as make_report
from kiln.graph.capture import Captured
from kiln.graph.partition import Placement, group, place, split, takes
from kiln.graph.validation import NARROW
from kiln.host import target as target_mod, tf32 as tf32_host
from kiln.observe import build_log
from kiln.runtime.model import HOST_CONSTANTS
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.program import build as build_program
from kiln.compiler import measure, quantized
from kiln.compiler.options import CompileOptions
from kiln.compiler.selection import compile_partition, primary, quantizes


@dataclass(frozen=True)
class Plan:
    """Where every op of one captured graph runs, and why."""
    captured: Captured
    options: CompileOptions          # as resolved for this graph (auto-cast may choose the engine)
    engine: object                   # the primary engine: placement and report are against it
    placement: Placement
    report: AnalysisReport
    precision: dict | None = None    # the auto-cast record for the manifest
    whole_graph_later: str | None = None   # whole_graph="later": the engine to build the whole graph on
    narrow_whole: bool = False       # whole on Inductor for its native bf16/fp16, not for whole_graph


@dataclass(frozen=True)
class Build:
    """Every device partition compiled, and the host program that wires them."""
    plan: Plan
    program: dict
    partitions: list                 # manifest records, one per partition
    blobs: dict = field(default_factory=dict)   # artifact member name -> bytes
    runners: list = field(default_factory=list)  # each partition as its checks loaded it, or None


def plan(captured: Captured, opts: CompileOptions, progress, narrow_whole: bool = True) -> Plan:
    """Auto-cast, place ops on the primary engine or the host, and report op support.
    ``narrow_whole=False``: not whole on Inductor for native bf16/fp16 alone (the driver's
    second plan, where that build failed its check)."""
    notes: list = []
    opts, precision = apply_auto_cast(captured, opts, notes)
    engine, engine_notes = primary(opts)
    notes += engine_notes
    with progress.phase("analyze"):
        # the verdicts first: where the whole graph goes to another engine at once, the
        # first engine's partitions are never made
        placement = place(captured.graph_module, engine, opts, grouped=False)
        if _dropout_splits(opts, engine, placement) and dropout.draw_masks_apart(captured.graph_module):
            notes.append("dropout's masks are drawn on the host before the graph runs, the rest stays whole "
                         f"on {engine.name} (kiln.graph.dropout)")
            placement = place(captured.graph_module, engine, opts, grouped=False)
        whole, later = _whole_graph_engine(opts, engine, placement, narrow_whole), None
        narrow = whole is not None and not opts.whole_graph
        # whole_graph="later" (the device's background builds): the whole graph on OpenVINO
        # first where it takes every operation, a build of seconds (_whole_on_openvino); else
        # the first engine's partitions, but only where they would not run the graph's bf16/fp16
        # work: where the first engine leaves it on a CPU that computes it natively, they run it
        # op by op, as the flushes before any build do (a bf16 BERT-4L step so built ran at 0.69x
        # eager, 11-29), and counting them took that step's analysis 3 s
        deferred = whole is not None and opts.whole_graph == "later"
        quick = _whole_on_openvino(captured.graph_module, opts) if deferred else None   # (engine, placement)
        first = deferred and quick is None and not _native_narrow_left(placement)
        if whole is None or first:
            group(captured.graph_module, placement, opts)
        if quick is not None:
            notes.append(f"{engine.name} would leave {len(placement.unsupported)} op(s) on the host; the whole "
                         f"graph goes to {quick[0].name} now and to {whole.name} later (whole_graph='later')")
            later, whole = whole.name, quick[0]
        elif first and len(placement.partitions) <= LATER_PARTITIONS:
            notes.append(f"{engine.name} leaves {len(placement.unsupported)} op(s) on the host; the whole "
                         f"graph on {whole.name} is due later (whole_graph='later')")
            later, whole = whole.name, None
        if whole is not None:
            if later is None:
                notes.append(f"{engine.name} would leave {len(placement.unsupported)} op(s) on the host; "
                             f"the whole graph goes to {whole.name} (whole_graph)")
            opts, engine = dataclasses.replace(opts, engine=whole.name, engine_by="whole_graph"), whole
            placement = (group(captured.graph_module, quick[1], opts) if quick      # placed already
                         else place(captured.graph_module, engine, opts))
        rep = make_report(captured.graph_module, placement, captured.model_name, engine.name)
    rep.notes.extend(notes)
    if not placement.partitions:
        rep.notes.append(f"No operator is placed on the {engine.name} engine; the whole model "
                         "runs on the host with PyTorch")
    return Plan(captured, opts, engine, placement, rep, precision, later, narrow)


# whole_graph="later" builds the partitions first only where they are few: each is a build,
# a check and probes, and the engines after the first may take one (Inductor among them). A
# bf16 BERT-4L step, which ONNX Runtime splits into 33 pieces around 595 host operations,
# built them one by one on Inductor (7-10 s each); its whole graph is one build.
LATER_PARTITIONS = 4


def _dropout_splits(opts, engine, placement) -> bool:
    """Whether dropout is what keeps ``engine`` from the graph: it cannot draw eager's masks,
    and the graph has a training ``native_dropout`` on the host (with ``whole_graph``: and
    nothing else there but the layout copies capture made for it, else Inductor takes the
    graph as it is)."""
    dropout_op = torch.ops.aten.native_dropout.default
    if getattr(engine, "draws_from_torch", False) or not any(n.target is dropout_op for n in placement.unsupported):
        return False
    return not opts.whole_graph or all(n.target is dropout_op or n.meta.get(randomness.RELAYOUT)
                                       for n in placement.unsupported)


def _whole_graph_engine(opts, first, placement, narrow_whole=True):
    """With ``whole_graph``: the engine that takes every operation (Inductor) when the
    first engine would leave some on the host, else None. Training graphs are where it
    matters: a host op splits a step into partitions that take turns with it (a CNN's
    ``convolution_backward``, before kiln decomposed it for ONNX Runtime: 37 ms a step
    split, 30 ms whole on Inductor). A dropout mask drawn apart (:mod:`kiln.graph.dropout`)
    reads nothing the graph computes, splits nothing and does not count."""
    unsupported = [n for n in placement.unsupported if not dropout.is_mask_draw(n)]
    if opts.engine or not unsupported or first.name == "inductor":
        return None
    if not opts.whole_graph and not (narrow_whole and _native_narrow_left(placement)):
        return None
    if _emulated_narrow_floats(placement):
        # Inductor computes bf16/fp16 op by op where the CPU lacks them, as eager does: a
        # bf16 BERT step whole on it ran at 0.83x eager, in ONNX Runtime/OpenVINO
        # partitions (products with float accumulation) at 4.4x
        return None
    whole = engines.get("inductor", required=False)
    if whole is None or any(takes(whole, n) is not None for n in unsupported):
        return None
    return whole


def _whole_on_openvino(gm, opts):
    """``(OpenVINO, its placement)`` where it takes every operation of ``gm``, else None: the
    first build of a graph due on Inductor later. It builds in seconds where Inductor takes
    tens of them: a bf16 BERT-4L training step (2,750 operations) built in 5 s against
    Inductor's 38 s, and ran at 1.6-1.9x eager's run of the graph, every output within
    eager's tolerances at bf16's floor (11-29). Inductor's build follows in the background
    and takes over only where it measures faster (:func:`kiln.device.graphs.faster`)."""
    quick = engines.get("openvino", required=False)
    if quick is None:
        return None
    placement = place(gm, quick, opts, grouped=False)
    if any(not dropout.is_mask_draw(n) for n in placement.unsupported):
        return None
    return quick, placement


def _native_narrow_left(placement) -> bool:
    """Whether the first engine leaves bf16/fp16 operations on the host on a CPU that computes
    that type natively: a bf16 model (ONNX Runtime's CPU build has no bf16 kernels, OpenVINO's
    plugin does not round to bf16 exactly). Without ``whole_graph`` a bf16 BERT-4L ran its
    layers op by op on the host around a small ONNX Runtime partition (its mask), at
    0.69-0.94x eager, and a bf16 MLP eagerly behind a warning; whole on Inductor the BERT
    ran at 1.7-2.1x eager on this AMX Xeon (batch 1, 128 tokens: 3.7-4.4 ms against
    7.6-7.7, 11-29). At -O2 the whole graph is still timed against eager, which keeps it
    where faster."""
    for node in placement.unsupported:
        kinds = {NARROW[d] for d in Engine.dtypes(node) if d in NARROW}
        if kinds and all(target_mod.native(kind) for kind in kinds):
            return True
    return False


def _emulated_narrow_floats(placement) -> bool:
    for node in placement.on_device:
        val = node.meta.get("val")
        dtype = getattr(val, "dtype", None)
        kind = NARROW.get(dtype)
        if kind is not None and not target_mod.native(kind):
            return True
    return False


def refuse_unsupported(p: Plan):
    """Ops the engine cannot run, with fallback off, are an error naming each one and where."""
    unsupported = [u for u in p.report.unsupported_ops if u["engine_unsupported"]]
    if unsupported and not p.options.fallback:
        lines = [f"  {u['op']} (x{u['count']}): {u['reason']}" +
                 "".join(f"\n      at {loc}" for loc in u["locations"]) for u in unsupported]
        raise UnsupportedOpError(
            f"{p.captured.model_name} uses {len(unsupported)} operator(s) the {p.engine.name} engine "
            "cannot run and fallback is disabled:\n" + "\n".join(lines) +
            "\nEnable fallback=True to run them on the host with PyTorch, or rewrite those lines.")
    if not p.placement.partitions:
        warnings.warn(f"kiln: no operator of {p.captured.model_name} is placed on the {p.engine.name} "
                      "engine; returning a model that runs entirely on the host with PyTorch",
                      stacklevel=4)


def build(p: Plan, runtime_opts: RuntimeOptions, progress, calibration=None) -> Build:
    """Split the graph at the placement and compile each partition on its engine.

    ``calibration``: flat input lists for static quantization (default: the example)."""
    fused = split(p.captured.graph_module, p.placement)
    program, constants, submodules = build_program(fused)
    part_inputs, part_outputs = partition_io(fused, p.captured.example_inputs)
    samples = [partition_io(fused, flat)[0] for flat in calibration or ()] or [part_inputs]
    blobs, partitions, runners = {}, [], []
    for i, sub in enumerate(submodules):
        label = f"partition {i + 1}/{len(submodules)}"
        engine, blob, record, runner = compile_partition(i, sub, part_inputs[i], p.options, runtime_opts,
                                                         progress, label, calibration=[s[i] for s in samples])
        runners.append(runner)
        if build_log.enabled():
            build_log.record(_log_entry(p, label, i, record))
        blob_name = f"partitions/{i}{engine.blob_suffix}"
        blobs[blob_name] = blob
        partitions.append({
            "id": i, "blob": blob_name, "num_ops": p.report.partitions[i]["num_ops"], **record,
            "inputs": [_spec(f"in{j}", t) for j, t in enumerate(part_inputs[i])],
            "outputs": [_spec(f"out{j}", t) for j, t in enumerate(part_outputs[i])],
        })
    if constants:
        from safetensors.torch import save as st_save
        blobs[HOST_CONSTANTS] = st_save(constants)
    return Build(p, program, partitions, blobs, runners)


def _log_entry(p: Plan, label: str, i: int, record: dict) -> dict:
    report = p.report.to_dict()
    return {"model": p.captured.model_name, "partition": label, "ops": report["partitions"][i]["ops"],
            "optlevel": p.options.optlevel, "engine": record["engine"], "choice": record["choice"],
            "compile_seconds": record["compile_seconds"], "candidates": record["candidates"],
            "host_ops": report["unsupported_ops"], "notes": report["notes"]}


def package(b: Build) -> Artifact:
    """The artifact: manifest (I/O, program, partitions, report) and the blobs."""
    p, captured = b.plan, b.plan.captured
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kiln_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_name": captured.model_name,
        "engine": {"name": p.engine.name, "version": p.engine.version()},
        "engines": sorted({(r["engine"], r["engine_version"]) for r in b.partitions}),
        "target": target_mod.describe(p.options.target, p.options.device),
        "compile_options": p.options.to_dict(),
        # an input that indexes carries the range eager accepts, checked at each call
        "inputs": {"args": captured.arg_names, "structure": captured.input_structure,
                   "positional": captured.positional,
                   "tensors": index_ranges.recorded(captured)},
        "outputs": {"structure": captured.output_structure,
                    "tensors": [s.to_dict() for s in captured.output_specs]},
        "program": b.program,
        "partitions": b.partitions,
        "report": p.report.to_dict(),
    }
    if p.precision:
        manifest["precision"] = p.precision
    if p.whole_graph_later:
        manifest["whole_graph_later"] = p.whole_graph_later
    if p.options.quantize:
        total = quantized.summary(b.partitions)
        if total is not None:
            manifest["quantized"] = total
        for note in quantized.notes(total, p.options.quantize, p.options.quantize_mode):
            manifest["report"]["notes"].append(note)
            warnings.warn(f"kiln: {p.captured.model_name}: {note}", stacklevel=4)
    speed = measure.summarize(b.partitions)
    if speed:
        manifest["speed_vs_eager"] = speed
    manifest["report"]["notes"] += measure.notes(b.partitions)
    return Artifact(manifest, dict(b.blobs))


def apply_auto_cast(captured: Captured, opts: CompileOptions, notes: list):
    """--auto-cast, applied to the graph before partitioning: (options, precision record).

    On a GPU the ops are lowered to the type; on a CPU an engine that computes the type
    natively is chosen when there is one; otherwise the rounding is emulated in fp32 so
    the user sees the accuracy they would get (and a warning that it is not faster)."""
    if opts.auto_cast == "none" or opts.auto_cast_type == "fp32":
        return opts, None
    from kiln.graph import precision
    kind, cast = opts.auto_cast, opts.auto_cast_type
    if opts.device == "cuda" and cast == "tf32":
        return opts, _tf32(kind)
    if opts.device == "cuda":
        if not precision.native_on_gpu(cast):
            raise CompilerArgsError(f"--auto-cast-type {cast} is not computed natively by "
                                    f"this GPU ({torch.cuda.get_device_name()}); use fp16, or device='cpu' "
                                    "to emulate its rounding")
        n = precision.lower(captured.graph_module, kind, cast)
        return opts, {"auto_cast": kind, "type": cast, "emulated": False, "ops_lowered": n,
                      "note": f"{n} op(s) computed in {cast} on the GPU"}
    native = engines.native_engine(cast, "cpu", among=opts.engine) if target_mod.native(cast) else None
    if native is not None and opts.quantize and not quantizes(engines.describe(native), opts):
        # the engine computing the type natively cannot quantize as asked: said, not blamed on an
        # engine the user never named (it read "engine='openvino' was named")
        able = getattr(engines.describe(native), "quantize_modes", ())
        raise CompilerArgsError(
            f"--auto-cast-type {cast} with quantize={opts.quantize!r} (quantize_mode={opts.quantize_mode!r}): "
            f"{engines.get(native).title} computes {cast} natively on this CPU but quantizes only "
            f"{' or '.join(able) or 'nothing'}; use quantize_mode='weight_only' (or quantize='int4') with "
            f"--auto-cast, or drop --auto-cast to quantize {opts.quantize_mode} on an engine that can")
    if native is not None:
        return dataclasses.replace(opts, engine=native, engine_by=opts.engine_by if opts.engine else "auto_cast"), {
            "auto_cast": kind, "type": cast, "emulated": False,
            "note": f"{cast} computed natively by {engines.get(native).title}, which chooses the ops that compute "
                    f"in it: matmuls and convolutions; element-wise ops may keep fp32 accuracy, so --auto-cast "
                    f"{kind} can answer as matmult does"}
    n = precision.emulate(captured.graph_module, kind, cast, keep_constants=bool(opts.quantize))
    note = (f"{cast} is emulated: inputs of {n} op(s) are rounded to {cast} and computed in "
            "fp32, to show its accuracy, not to gain speed")
    notes.append(note)
    warnings.warn(f"kiln: {note}", stacklevel=4)
    return opts, {"auto_cast": kind, "type": cast, "emulated": True, "ops_rounded": n, "note": note}


def _tf32(kind: str) -> dict:
    """--auto-cast-type tf32 on a GPU: nothing in the graph changes; the compile and its check
    run with torch's TF32 flags on (kiln.compiler.driver), and the check holds the model to
    TF32's precision instead of the accuracy gate. Refused where the GPU has no TF32."""
    if not tf32_host.computed_here():
        raise CompilerArgsError(f"--auto-cast-type tf32 needs TF32 tensor cores (NVIDIA Ampere, compute "
                                f"capability 8.0, or later); {torch.cuda.get_device_name()} computes fp32 "
                                "in fp32: drop the flag, or use fp16")
    return {"auto_cast": kind, "type": "tf32", "emulated": False,
            "note": "fp32 matmuls and convolutions may compute in TF32 on the GPU's tensor cores; compiled "
                    "and checked with torch's TF32 flags on. At run time the package's cuBLAS and cuDNN "
                    "calls follow the running process's flags: torch.backends.cuda.matmul.fp32_precision = "
                    "'tf32' (or torch.set_float32_matmul_precision('high')) for TF32 matmuls there"}


def partition_io(fused, example_inputs):
    """Run the split graph once in PyTorch to get each partition's example inputs/outputs."""
    ins, outs = {}, {}

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            result = super().call_module(target, args, kwargs)
            ins[target] = [a for a in args]
            outs[target] = list(result) if isinstance(result, (tuple, list)) else [result]
            return result

    with torch.no_grad():
        Recorder(fused).run(*example_inputs)
    order = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    return [ins[t] for t in order], [outs[t] for t in order]


def _spec(name, t):
    return specs.TensorSpec(name, tuple(t.shape), t.dtype).to_dict()
