"""The compiler driver: one graph at one set of shapes, through the phases, past the hooks.

:func:`compile_graph` runs capture → plan → build → package (:mod:`kiln.compiler.phases`),
loads the artifact and checks it against eager PyTorch. Whatever wraps a compile
(the persistent cache, parallel-compile's collect pass) is a *hook* handed in by the
caller (:mod:`kiln.compiler.api`), never imported here: a hook is called with the
:class:`GraphJob` and a ``compile(captured=None)`` function, and returns the model,
from the cache, from ``compile`` or a stand-in, so the driver knows none of them.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from kiln.artifact import specs
from kiln.compiler import phases, quantized
from kiln.compiler.options import (CompileOptions, asks_tf32, check_device_precision,
                                   check_supported, parse_compiler_args, tf32_ops)
from kiln.compiler.selection import resolve_device
from kiln.compiler.reuse import capture_for, copy_of
from kiln.errors import CaptureError, InputError, KilnError, ValidationError
from kiln.graph import randomness, tracing_lock, widened
from kiln.graph.capture import Captured, bind_inputs, call_bound, eval_mode, from_graph
from kiln.graph.validation import TF32_RTOL, comparison_precision, compare, quality_gate
from kiln.host import tf32 as tf32_host
from kiln.observe import build_log
from kiln.observe.metrics import forget_calls
from kiln.progress import Progress
from kiln.runtime.model import CompiledModel
from kiln.runtime.options import RuntimeOptions

# trace() keywords that are CompileOptions fields; the rest are settings of the trace.
OPTION_FIELDS = ("engine", "optlevel", "target", "device", "fallback", "min_partition_size",
                 "ops_on_host", "validate", "atol", "rtol", "quantize", "quantize_mode",
                 "min_cosine", "min_top1", "compile_budget", "whole_graph", "engine_by")


def make_options(compiler_args=None, **overrides) -> CompileOptions:
    """Parse Neuron-style flags once, apply keyword overrides, check and settle the device."""
    fields = parse_compiler_args(compiler_args)
    for key, value in overrides.items():
        if value is not None:
            fields[key] = frozenset(value) if key == "ops_on_host" else value
    opts = CompileOptions(**fields)
    check_supported(opts)
    opts = resolve_device(opts)
    check_device_precision(opts)
    return opts


@dataclass(frozen=True)
class GraphJob:
    """One graph to compile, as hooks see it: the model and example call, the parsed
    options, and the settings that are not options (they do not change the graph)."""
    model: object
    args: object
    kwargs: object
    options: CompileOptions
    compiler_args: object = None      # as the user gave them (recorded with cache failures)
    name: str | None = None
    threads: int | None = None
    calibration: tuple = ()           # static-quantization samples: bypass the cache
    label: str | None = None
    extra: dict = field(default_factory=dict)


class Hook(Protocol):
    """Wraps one compile: returns a model for ``job``, calling ``compile(captured=None)``
    if it needs one built (the cache on a miss), or not at all (a hit, a stand-in)."""

    def __call__(self, job: GraphJob, compile: Callable[..., CompiledModel]) -> CompiledModel: ...


def run_job(job: GraphJob, hook: Hook | None = None, progress=None) -> CompiledModel:
    """Compile ``job``, through ``hook`` when one is given. The hook may capture the graph
    itself (to key it) and pass the ``Captured`` on, so nothing is captured twice."""
    progress = progress or Progress()

    def compile_(captured=None):
        return compile_graph(job.model, job.args, job.kwargs, job.options, name=job.name,
                             threads=job.threads, calibration_data=job.calibration,
                             progress=progress, label=job.label, captured=captured)

    return compile_() if hook is None else hook(job, compile_)


def compile_graph(model, example_inputs, example_kwargs, opts: CompileOptions, *, name=None,
                  threads=None, calibration_data=(), progress=None, label=None,
                  captured: Captured | None = None) -> CompiledModel:
    """Compile one graph at one set of shapes (``kiln.trace`` without shape adapters)."""
    progress = progress or Progress()
    # a capture made for this compile by the caller's hook (the cache keys by it) is its phase too
    progress.timings = {} if getattr(captured, "capture_seconds", None) is None else \
        {"capture": captured.capture_seconds}
    progress.label = f"kiln {label}" if label else "kiln"
    started = time.perf_counter()
    if captured is None:
        with progress.phase("capture"):
            captured = capture_for(model, example_inputs, example_kwargs)
    if name:
        captured.model_name = name
    return _compile_captured(captured, opts, model, threads, calibration_data, progress, started)


def compile_fx(gm: torch.fx.GraphModule, example_inputs, opts: CompileOptions | None = None, *,
               name: str = "graph", threads=None, progress=None) -> CompiledModel:
    """Compile an FX graph of flat tensors in and out, entering at the plan phase: for a
    ``torch.compile`` backend, a lazy device's ``mark_step``, or any caller holding a graph."""
    progress = progress or Progress(quiet=True)
    progress.timings = {}
    started = time.perf_counter()
    captured = from_graph(gm, example_inputs, name)
    return _compile_captured(captured, opts or make_options(), gm, threads, (), progress, started)


def _compile_captured(captured, opts, model, threads, calibration_data, progress, started):
    # engines' builds trace too (Inductor's AOTAutograd, the exporter's decompositions), in
    # process-wide slots: one build at a time (kiln.graph.tracing_lock; four Inductor builds
    # from four threads: three failed)
    with tracing_lock.held():
        return _compile_planned(captured, opts, model, threads, calibration_data, progress, started)


def _compile_planned(captured, opts, model, threads, calibration_data, progress, started):
    quantized.check_float32_weights(captured, opts)
    plan = phases.plan(captured, opts, progress)
    if not plan.narrow_whole:
        return _build_checked(plan, model, threads, calibration_data, progress, started)
    # Whole on Inductor for its native bf16/fp16 (kiln.compiler.phases._native_narrow_left):
    # the first engine's plan is kept where that build fails its check (even against the
    # graph in float32, see check), as before the rule, rather than fail a compile that used
    # to succeed. Partitioning rewrites the graph, so the check and a second plan get a copy
    # (the check only reads it: kiln.graph.widened changes a copy of its own).
    spare = copy_of(captured)
    try:
        return _build_checked(plan, model, threads, calibration_data, progress, started, spare)
    except ValidationError as e:
        plan = phases.plan(spare, opts, progress, narrow_whole=False)
        plan.report.notes.append(f"the whole graph on Inductor (this CPU computes its bf16/fp16 natively) did "
                                 f"not match eager, so {plan.engine.name}'s plan was kept: {str(e)[:300]}")
        return _build_checked(plan, model, threads, calibration_data, progress, started)


def _build_checked(plan, model, threads, calibration_data, progress, started, unsplit=None):
    """Build ``plan`` and check it against eager. ``unsplit``: the capture before partitioning,
    for judging a narrow graph against its float32 computation (:func:`check`)."""
    captured = plan.captured
    phases.refuse_unsupported(plan)
    samples = [flat_sample(model, captured, s) for s in calibration_data]
    runtime_opts = RuntimeOptions(threads=threads)
    # --auto-cast-type tf32: the engine compiles, and its builds are checked, with TF32 allowed
    tf32 = tf32_host.allowed() if asks_tf32(plan.options) and plan.options.device == "cuda" else None
    with tf32 or contextlib.nullcontext():
        built = phases.build(plan, runtime_opts, progress, calibration=[flat for flat, _ in samples])
        compiled = CompiledModel(phases.package(built), runtime_opts, loaded=(runtime_opts, built.runners))
        check(compiled, plan, samples, progress, unsplit)
        forget_calls(compiled)   # the validation's / gate's calls are kiln's, not the user's
    compiled.manifest["compile_seconds"] = round(time.perf_counter() - started, 3)
    if defaults := omitted_defaults(model, captured.arg_names):
        compiled.manifest["omitted_defaults"] = defaults
    compiled.manifest["phases"] = {k: round(v, 3) for k, v in progress.timings.items()}
    build_log.record({"model": captured.model_name, "graph": "whole compile",
                      "compile_seconds": compiled.manifest["compile_seconds"], "phases": compiled.manifest["phases"]})
    return compiled


def check(compiled: CompiledModel, plan: phases.Plan, samples, progress, unsplit=None):
    """Compare the loaded model with eager PyTorch; lossy compiles (int8, auto-cast) pass an
    accuracy gate instead. The result lands in the manifest's ``validation``. A graph sent
    whole to Inductor for its native bf16/fp16 (``plan.narrow_whole``) that misses eager's
    float answers only by bf16's roundings passes when it is no further than eager from the
    graph computed in float32 (``unsplit``: :mod:`kiln.graph.widened`)."""
    opts, captured, precision = plan.options, plan.captured, plan.precision
    manifest = compiled.manifest
    if opts.quantize or (precision and precision["type"] != "tf32"):
        with progress.phase("accuracy gate"):
            randomness.restore(captured.draws)
            pairs = [(captured.eager_outputs, compiled.run_flat(captured.example_inputs))]
            pairs += [(ref, compiled.run_flat(flat)) for flat, ref in samples]
            what = (f"quantized to {opts.quantize}" if opts.quantize else
                    f"auto-cast {opts.auto_cast} to {opts.auto_cast_type} "
                    f"({'emulated' if precision['emulated'] else 'native'})")
            engines = sorted({p["engine"] for p in manifest["partitions"]}) or ["the host"]
            manifest["validation"] = quality_gate(pairs, opts.min_cosine, opts.min_top1,
                                                  f"{captured.model_name} {what} (on {', '.join(engines)})",
                                                  names=[s.name for s in captured.output_specs])
            manifest["validation"].update(max_abs_error(pairs[0]))
    elif opts.validate:
        with progress.phase("validate"):
            randomness.restore(captured.draws)
            actual = compiled.run_flat(captured.example_inputs)
            used = comparison_precision(captured.graph_module, opts.device, tf32_ops(opts))
            try:
                manifest["validation"] = compare(captured.eager_outputs, actual,
                                                 [s.name for s in captured.output_specs], opts.atol, opts.rtol,
                                                 computed_in=used)
            except ValidationError as e:
                verdict = _nearer_than_eager(plan, unsplit, actual, e.metrics)
                if verdict is None:
                    raise
                manifest["validation"] = dict(e.metrics, passed=True, against_float32=verdict)
                manifest["report"]["notes"].append(
                    f"{used}'s roundings: the build differs from eager beyond {used}'s floor (max abs error "
                    f"{e.metrics.get('max_abs_error', 0):.3g}) but is no further than eager from the graph "
                    "computed in float32, so it passed")
            if used == "tf32":
                manifest["report"]["notes"].append(tf32_note(opts))


def _nearer_than_eager(plan, unsplit, actual, summary) -> dict | None:
    """:func:`kiln.graph.widened.nearer_than_eager` for a narrow whole-graph build whose only
    failures are float outputs beyond tolerance (never a dtype or an integer difference)."""
    if unsplit is None or not plan.narrow_whole or any(
            "dtype" in o or o.get("exact") is False for o in summary.get("outputs", [])):
        return None
    return widened.nearer_than_eager(unsplit.graph_module, unsplit.example_inputs, unsplit.eager_outputs, actual)


def tf32_note(opts) -> str:
    why = ("--auto-cast-type tf32 lets its fp32 matmuls and convolutions compute in TF32" if asks_tf32(opts)
           else "torch's flags let this GPU compute its fp32 " + " and ".join(
               {"conv": "convolutions (cuDNN; torch's default)", "matmul": "matmuls (cuBLAS)"}[k]
               for k, on in tf32_host.in_effect().items() if on) + " in TF32, as eager does")
    return (f"checked against eager at TF32 precision (rtol {TF32_RTOL:g}, atol that times each "
            f"output's largest magnitude): {why}")


def omitted_defaults(model, arg_names) -> dict:
    """``{name: default}`` of the parameters the example call left to their defaults, where
    the default is None, a bool, an int, a float or a string: a call may pass one explicitly
    at that value (``token_type_ids=None``), which the graph computed with
    (:func:`kiln.runtime.value_checks.explicit_default`)."""
    import inspect
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    given = {n.partition("[")[0] for n in arg_names}
    return {p.name: p.default for p in params
            if p.name not in given and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and (p.default is None or type(p.default) in (bool, int, float, str))}


def flat_sample(model, captured, sample):
    """Flatten one calibration input like the example inputs, with its eager outputs."""
    args, kwargs = (None, sample) if isinstance(sample, dict) else (sample, None)
    try:
        named = bind_inputs(model, args, kwargs)
        flat: list = []
        for name, structure in captured.input_structure["dict"]:
            specs.flatten_inputs(structure, named.get(name), name, flat)
    except (CaptureError, InputError, KilnError) as e:
        raise InputError(f"a calibration_data sample does not fit the model's example inputs: {e}") from None
    for spec, value in zip(captured.input_specs, flat):     # torch's or an engine's error, until 12-03
        if isinstance(value, torch.Tensor) and (tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype):
            raise InputError(f"calibration_data: input '{spec.name}' of a sample is {value.dtype}"
                             f"{list(value.shape)}, the example's {spec.dtype}{list(spec.shape)}: calibration samples "
                             "are calls like the example (the same shapes and dtypes)")
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise InputError(f"calibration_data: input '{spec.name}' of a sample holds NaN or infinities, which "
                             "leave no range to calibrate to")
    with torch.no_grad(), eval_mode(model):      # as the capture ran it; its state left as it was
        ref_leaves: list = []
        specs.encode(call_bound(model, named), "", ref_leaves, [])
    return flat, [t.detach() for t in ref_leaves]


def max_abs_error(pair) -> dict:
    expected, actual = pair
    diffs = [(e.double() - a.double()).abs().max().item() for e, a in zip(expected, actual)
             if e.is_floating_point() and e.numel()]
    return {"max_abs_error": max(diffs, default=0.0)}
