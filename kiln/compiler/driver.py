"""The compiler driver: capture → analyze → partition → compile → artifact → validate."""
from __future__ import annotations

import datetime
import logging
import os
import time
import warnings

import torch

from kiln import __version__

from kiln import engines as backends

from kiln.compiler import padcheck

from kiln.artifact import specs
from kiln.host import target as target_mod
from kiln.graph.analysis import AnalysisReport, report as make_report
from kiln.artifact.container import FORMAT, FORMAT_VERSION, Artifact
from kiln.graph.capture import bind_inputs, call_bound, capture
from kiln.errors import (ArtifactError, CompileError, CompilerArgsError, UnsupportedOpError,
                     ValidationError)
from kiln.compiler.options import CompileOptions, RuntimeOptions, check_supported, parse_compiler_args
from kiln.graph.partition import place, split
from kiln.runtime.program import build
from kiln.progress import Progress
from kiln.runtime.model import HOST_CONSTANTS, CompiledModel
from kiln.compiler.selection import compile_partition, primary, resolve_device
from kiln.graph.validation import compare, quality_gate

log = logging.getLogger("kiln")


def make_options(compiler_args=None, **overrides) -> CompileOptions:
    fields = parse_compiler_args(compiler_args)
    for key, value in overrides.items():
        if value is not None:
            if key == "ops_on_host":
                value = frozenset(value)
            fields[key] = value
    opts = CompileOptions(**fields)
    check_supported(opts)
    return resolve_device(opts)


def _plan(model, example_inputs, example_kwargs, opts, progress, captured=None):
    if captured is None:
        with progress.phase("capture"):
            captured = capture(model, example_inputs, example_kwargs)
    notes: list = []
    precision = _apply_auto_cast(captured, opts, notes)   # may pick the engine (native bf16)
    backend, engine_notes = primary(opts)
    notes += engine_notes
    with progress.phase("analyze"):
        placement = place(captured.graph_module, backend, opts)
        rep = make_report(captured.graph_module, placement, captured.model_name, backend.name)
    rep.notes.extend(notes)
    if not placement.partitions:
        rep.notes.append(f"No operator is placed on the {backend.name} engine; the whole model "
                         "runs on the host with PyTorch")
    return captured, backend, placement, rep, precision


def analyze(model, example_inputs=None, example_kwargs=None, *, engine=None, device=None,
            compiler_args=None, min_partition_size=None, ops_on_host=None, quiet=None) -> AnalysisReport:
    """Report op support and the partitioning a trace would use, without compiling."""
    opts = make_options(compiler_args, engine=engine, device=device, min_partition_size=min_partition_size,
                        ops_on_host=ops_on_host)
    _, _, _, rep, _ = _plan(model, example_inputs, example_kwargs, opts, Progress(quiet=quiet))
    return rep


def trace(model, example_inputs=None, example_kwargs=None, *, buckets=None, pad_values=None,
          output_dims=None, dynamic_batch=False, pipeline_cores=None, compiler_args=None,
          quiet=None, cache=None, retry_failed=False, **options):
    """Compile ``model`` ahead of time for this machine and return the loaded result.

    ``example_inputs`` is a tensor, a tuple of positional inputs or a dict of
    keyword inputs (``example_kwargs`` adds keywords to positional ones).
    ``quantize="int8"`` quantizes weights (``quantize_mode="dynamic"``, the
    default without data) or weights and activations calibrated on
    ``calibration_data``, an iterable of example inputs (``"static"``, the
    default with data); the result must pass ``min_cosine``/``min_top1``.

    Shapes and cores: ``buckets`` (``{input: {dim: [sizes]}}`` or a list of
    example inputs) compiles one variant per size, padded with ``pad_values``
    (``{input: value}``, default 0) and sliced back along ``output_dims``
    (inferred unless given); ``dynamic_batch=True`` accepts any batch size on
    dim 0; ``pipeline_cores=N`` splits the graph into N stages on N kiln cores.
    ``device`` is where the model runs: "cpu", "cuda" (TorchInductor's Triton
    kernels on an NVIDIA GPU) or "auto", the default: the GPU when torch sees one.
    Other keywords are compile options (``engine``, ``optlevel``, ``target``,
    ``fallback``, ``threads``, ``name``, ...).

    Compiled graphs are kept in the persistent cache (``cache``: None for
    ``KILN_CACHE_URL`` or ``~/.cache/kiln``, an fsspec URL, a ``kiln.compiler.cache.Cache``,
    or False); a graph that failed before fails again from the cache unless
    ``retry_failed=True``.
    """
    from kiln.compiler import cache as cache_mod
    store = cache_mod.open_cache(cache)
    if pipeline_cores is None:
        pipeline_cores = parse_compiler_args(compiler_args).get("pipeline_cores", 1)
    progress = Progress(quiet=quiet)
    tol = _padding_tolerance(compiler_args, options)   # for the padding and batch checks

    def trace_one(m, args, kwargs, label=None):
        def compile_(captured=None):
            return _trace_graph(m, args, kwargs, compiler_args=compiler_args, quiet=quiet,
                                progress=progress, label=label, captured=captured, **options)
        if store is None or options.get("calibration_data") is not None:
            return compile_()
        return _cached(store, m, args, kwargs, compiler_args, options, retry_failed, compile_, progress)

    if store is not None and os.environ.get("KILN_COLLECT_DIR"):
        return _collect(model, example_inputs, example_kwargs, buckets, pad_values, pipeline_cores,
                        trace_one)
    if pipeline_cores and pipeline_cores > 1:
        if buckets is not None:
            raise CompilerArgsError("pipeline_cores and buckets cannot be combined yet; "
                                    "compile one pipeline per shape")
        if options.get("calibration_data") is not None:
            raise CompilerArgsError("static quantization (calibration_data=) cannot be combined "
                                    "with pipeline_cores yet: the samples are the model's inputs, "
                                    "not each stage's; use quantize_mode='dynamic'")
        from kiln.runtime.stages import trace_pipeline
        compiled = trace_pipeline(model, example_inputs, example_kwargs, pipeline_cores, trace_one,
                                  progress)
    elif buckets is not None:
        from kiln.runtime.buckets import bucket_examples, trace_buckets
        examples = bucket_examples(model, example_inputs, example_kwargs, buckets, pad_values)
        compiled = trace_buckets(model, examples, pad_values, output_dims, trace_one)
        if tol is not None:
            with progress.phase("padding check"):
                compiled.manifest["padding_check"] = padcheck.check_buckets(model, compiled, examples, tol)
    else:
        if pad_values or output_dims:
            raise CompilerArgsError("pad_values and output_dims apply to buckets; pass buckets= too")
        compiled = trace_one(model, example_inputs, example_kwargs)
    if dynamic_batch:
        from kiln.runtime.buckets import DynamicBatch
        compiled = DynamicBatch(compiled)
        if tol is not None:
            with progress.phase("batch check"):
                compiled.manifest["batch_check"] = padcheck.check_dynamic_batch(
                    model, compiled, example_inputs, example_kwargs, tol)
    return compiled


def _padding_tolerance(compiler_args, options):
    """How closely padded and chunked answers must match eager (None: validate=False).
    Lossy compiles are held to their accuracy gate, not to atol."""
    fields = parse_compiler_args(compiler_args)
    if options.get("validate", fields.get("validate", True)) is False:
        return None
    lossy = options.get("quantize") or fields.get("quantize") or (
        fields.get("auto_cast", "none") != "none" and fields.get("auto_cast_type", "bf16") != "fp32")
    if lossy:
        cos = options.get("min_cosine")
        return padcheck.Tolerance(min_cosine=CompileOptions.min_cosine if cos is None else cos)
    atol, rtol = options.get("atol"), options.get("rtol")
    return padcheck.Tolerance(CompileOptions.atol if atol is None else atol,
                              CompileOptions.rtol if rtol is None else rtol)


def _collect(model, example_inputs, example_kwargs, buckets, pad_values, pipeline_cores, trace_one):
    """kiln parallel-compile's collect pass: record every graph this trace would compile
    and hand back the model itself. Pipelines are not collected: their stage cut comes
    from timings taken at compile time, so they compile in the normal run."""
    from kiln.compiler.collect import EagerStandIn
    if pipeline_cores and pipeline_cores > 1:
        log.warning("kiln parallel-compile: pipelines are compiled in the normal run, not collected")
        return EagerStandIn(model, None)
    if buckets is not None:
        from kiln.runtime.buckets import bucket_examples
        for n, (args, kwargs) in enumerate(bucket_examples(model, example_inputs, example_kwargs,
                                                           buckets, pad_values)):
            trace_one(model, args, kwargs, label=f"bucket {n + 1}")
        return EagerStandIn(model, None)
    return trace_one(model, example_inputs, example_kwargs)   # a cache hit is returned as is


def _trace_graph(model, example_inputs=None, example_kwargs=None, *, compiler_args=None,
                 engine=None, optlevel=None, target=None, device=None, fallback=None, min_partition_size=None,
                 ops_on_host=None, validate=None, atol=None, rtol=None, threads=None, name=None,
                 quiet=None, quantize=None, quantize_mode=None, calibration_data=None,
                 min_cosine=None, min_top1=None, progress=None, label=None,
                 captured=None) -> CompiledModel:
    """Compile one graph at one set of shapes (``trace`` without shape adapters)."""
    calibration_data = list(calibration_data) if calibration_data is not None else []
    if quantize and quantize_mode is None:
        quantize_mode = "static" if calibration_data else "dynamic"
    opts = make_options(compiler_args, engine=engine, optlevel=optlevel, target=target,
                        device=device, fallback=fallback, min_partition_size=min_partition_size,
                        ops_on_host=ops_on_host, validate=validate, atol=atol, rtol=rtol,
                        quantize=quantize, quantize_mode=quantize_mode, min_cosine=min_cosine,
                        min_top1=min_top1)
    progress = progress or Progress(quiet=quiet)
    progress.timings = {}
    progress.label = f"kiln {label}" if label else "kiln"
    started = time.perf_counter()
    captured, backend, placement, rep, precision = _plan(model, example_inputs, example_kwargs, opts,
                                                         progress, captured)
    if name:
        captured.model_name = rep.model_name = name

    unsupported = [u for u in rep.unsupported_ops if u["engine_unsupported"]]
    if unsupported and not opts.fallback:
        lines = [f"  {u['op']} (x{u['count']}): {u['reason']}" +
                 "".join(f"\n      at {loc}" for loc in u["locations"]) for u in unsupported]
        raise UnsupportedOpError(
            f"{captured.model_name} uses {len(unsupported)} operator(s) the {backend.name} engine "
            "cannot run and fallback is disabled:\n" + "\n".join(lines) +
            "\nEnable fallback=True to run them on the host with PyTorch, or rewrite those lines.")
    if not placement.partitions:
        warnings.warn(f"kiln: no operator of {captured.model_name} is placed on the {backend.name} "
                      "engine; returning a model that runs entirely on the host with PyTorch",
                      stacklevel=2)

    fused = split(captured.graph_module, placement)
    program, constants, submodules = build(fused)
    part_inputs, part_outputs = _partition_io(fused, captured.example_inputs)

    samples = [_flat_sample(model, captured, s) for s in calibration_data]
    calibration = [_partition_io(fused, flat)[0] for flat, _ in samples] or [part_inputs]
    runtime_opts = RuntimeOptions(threads=threads)
    blobs, partitions = {}, []
    for i, sub in enumerate(submodules):
        label = f"partition {i + 1}/{len(submodules)}"
        engine, blob, record = compile_partition(i, sub, part_inputs[i], opts, runtime_opts, progress,
                                                 label, calibration=[c[i] for c in calibration])
        blob_name = f"partitions/{i}{engine.blob_suffix}"
        blobs[blob_name] = blob
        partitions.append({
            "id": i, "blob": blob_name, "num_ops": rep.partitions[i]["num_ops"], **record,
            "inputs": [_spec(f"in{j}", t) for j, t in enumerate(part_inputs[i])],
            "outputs": [_spec(f"out{j}", t) for j, t in enumerate(part_outputs[i])],
        })
    if constants:
        from safetensors.torch import save as st_save
        blobs[HOST_CONSTANTS] = st_save(constants)

    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kiln_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_name": captured.model_name,
        "engine": {"name": backend.name, "version": backend.version()},
        "engines": sorted({(p["engine"], p["engine_version"]) for p in partitions}),
        "target": target_mod.describe(opts.target, opts.device),
        "compile_options": opts.to_dict(),
        "inputs": {"args": captured.arg_names, "structure": captured.input_structure,
                   "tensors": [s.to_dict() for s in captured.input_specs]},
        "outputs": {"structure": captured.output_structure,
                    "tensors": [s.to_dict() for s in captured.output_specs]},
        "program": program,
        "partitions": partitions,
        "report": rep.to_dict(),
    }
    compiled = CompiledModel(Artifact(manifest, blobs), runtime_opts)
    if precision:
        manifest["precision"] = precision
    if opts.quantize or precision:
        with progress.phase("accuracy gate"):
            pairs = [(captured.eager_outputs, compiled.run_flat(captured.example_inputs))]
            pairs += [(ref, compiled.run_flat(flat)) for flat, ref in samples]
            what = (f"quantized to {opts.quantize}" if opts.quantize else
                    f"auto-cast {opts.auto_cast} to {opts.auto_cast_type} "
                    f"({'emulated' if precision['emulated'] else 'native'})")
            manifest["validation"] = quality_gate(pairs, opts.min_cosine, opts.min_top1,
                                                  f"{captured.model_name} {what}")
            manifest["validation"].update(_errors(pairs[0]))
    elif opts.validate:
        with progress.phase("validate"):
            actual = compiled.run_flat(captured.example_inputs)
            manifest["validation"] = compare(captured.eager_outputs, actual,
                                             [s.name for s in captured.output_specs], opts.atol, opts.rtol)
    manifest["compile_seconds"] = round(time.perf_counter() - started, 3)
    manifest["phases"] = {k: round(v, 3) for k, v in progress.timings.items()}
    return compiled


_KEY_OPTIONS = ("engine", "optlevel", "target", "device", "fallback", "min_partition_size", "ops_on_host",
                "validate", "atol", "rtol", "quantize", "quantize_mode", "min_cosine", "min_top1")
# Failures that come from the graph and the options, so they recur on every machine
# with the same key; a missing engine or a killed process is not remembered.
_DETERMINISTIC = (CompileError, UnsupportedOpError, ValidationError)


def _cached(store, model, args, kwargs, compiler_args, options, retry_failed, compile_, progress):
    """Compile through the cache: fingerprint alias → entry; else capture → key → entry;
    else compile under the key's lock, store, and alias the fingerprint."""
    from kiln.compiler import cache as cache_mod
    opts = make_options(compiler_args, **{k: options.get(k) for k in _KEY_OPTIONS})
    extra = {"name": options.get("name")}
    from_cache = cache_reader(store, retry_failed, options.get("threads"))
    with progress.phase("cache lookup"):
        named = bind_inputs(model, args, kwargs)
        fp = cache_mod.fingerprint(model, named, opts, extra)
        key = store.alias(fp) if fp else None
        if key is not None:
            hit = from_cache(key)
            if hit is not None:
                store._count("alias_hits")
                return hit
    with progress.phase("capture"):
        captured = capture(model, args, kwargs)
    key = cache_mod.graph_key(captured, opts, extra)
    hit = from_cache(key)
    if hit is None:
        collect_dir = os.environ.get("KILN_COLLECT_DIR")
        if collect_dir:   # kiln parallel-compile's first pass: record, compile later
            from kiln.compiler.collect import record
            return record(collect_dir, model, captured, key, fp, store.url, compiler_args, options)
        return compile_into_cache(store, key, fp, captured, compile_, compiler_args, from_cache)
    if fp:
        store.set_alias(fp, key)
    return hit


def cache_reader(store, retry_failed, threads):
    """A function key -> loaded model from the cache, or None (then compile); a remembered
    failure raises CachedFailure unless ``retry_failed``.

    Entries are verified like any artifact, but their native code is trusted only by a
    signature (this host's key or ``KILN_TRUSTED_KEYS``; never ``KILN_TRUST_NATIVE_CODE``):
    anyone who can write to a shared store can replace an entry. An untrusted entry is a
    miss, kept for the hosts that trust it (its key lands in ``from_cache.untrusted``, and
    ``compile_into_cache`` does not overwrite it); a bad signature is corruption."""
    from kiln.compiler import cache as cache_mod
    from kiln.artifact import trust
    from kiln.artifact.container import Artifact
    from kiln.errors import UntrustedArtifactError
    untrusted: set = set()

    def from_cache(key):
        found = store.lookup(key)
        if found is None:
            return None
        status, payload, meta = found
        if status == "failed":
            if retry_failed:
                store.forget(key)
                return None
            store._count("failed_hits")
            raise cache_mod.CachedFailure(
                f"{meta.get('model_name', 'this model')} failed to compile on {meta.get('created', '?')[:19]} "
                f"with these options (cache key {key[:16]}): {payload}\nkiln does not retry known "
                "failures; pass retry_failed=True (kiln compile --retry-failed) to try again")
        try:
            where = f"cache entry {key[:16]}"
            art = Artifact.load(payload) if isinstance(payload, str) else Artifact.from_bytes(payload, where)
            trust.admit(art, where, trust_native_code=False)
            compiled = CompiledModel(art, RuntimeOptions(threads=threads), source=where)
        except UntrustedArtifactError as e:
            if key not in untrusted:
                untrusted.add(key)
                store._count("untrusted")
                log.warning("kiln cache: not loading entry %s, compiling instead: %s", key[:16], e)
            return None
        except ArtifactError as e:   # a corrupt entry; a missing engine or bad setting is no reason to drop it
            store.discard(key, e)
            return None
        store.touch(key, meta)
        store._count("hits")
        compiled.manifest["cache"] = {"key": key, "url": store.url, "hit": True}
        return compiled

    from_cache.untrusted = untrusted
    return from_cache


def compile_into_cache(store, key, fp, captured, compile_, compiler_args, from_cache):
    """Compile ``key`` once across processes: under its lock, unless another process
    stores it meanwhile (then that result is used), and remember deterministic failures."""
    with store.lock(key, wait_for=lambda: from_cache(key)) as ready:
        hit = ready or from_cache(key)
        if hit is not None:
            if fp:
                store.set_alias(fp, key)
            return hit
        store._count("misses")
        store._count("compiles")
        info = {"model_name": captured.model_name, "kiln_version": __version__,
                "options": compiler_args if isinstance(compiler_args, str) else " ".join(compiler_args or [])}
        try:
            compiled = compile_(captured)
        except _DETERMINISTIC as e:
            store.store_failure(key, e, info)
            raise
        compiled.manifest["cache"] = {"key": key, "url": store.url, "hit": False}
        engines = sorted({p["engine"] for p in compiled.manifest["partitions"]})
        if key in getattr(from_cache, "untrusted", ()):
            log.info("kiln cache: keeping entry %s (signed by a key this host does not trust) "
                     "for the hosts that trust it", key[:16])
        else:
            store.store(key, compiled.to_bytes(), dict(info, engine=",".join(engines) or "host"))
        if fp:
            store.set_alias(fp, key)
        return compiled


def _spec(name, t):
    return specs.TensorSpec(name, tuple(t.shape), t.dtype).to_dict()


def _partition_io(fused, example_inputs):
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


def _flat_sample(model, captured, sample):
    """Flatten one calibration input like the example inputs, with its eager outputs."""
    args, kwargs = (None, sample) if isinstance(sample, dict) else (sample, None)
    named = bind_inputs(model, args, kwargs)
    flat: list = []
    for name, structure in captured.input_structure["dict"]:
        specs.flatten_inputs(structure, named.get(name), name, flat)
    with torch.no_grad():
        ref_leaves: list = []
        specs.encode(call_bound(model, named), "", ref_leaves, [])
    return flat, [t.detach() for t in ref_leaves]


def _apply_auto_cast(captured, opts, notes):
    """Apply --auto-cast before partitioning; returns the manifest's precision record."""
    if opts.auto_cast == "none" or opts.auto_cast_type == "fp32":
        return None
    from kiln.graph import precision
    if opts.device == "cuda":
        if not precision.native_on_gpu(opts.auto_cast_type):
            raise CompilerArgsError(f"--auto-cast-type {opts.auto_cast_type} is not computed natively by "
                                    f"this GPU ({torch.cuda.get_device_name()}); use fp16, or device='cpu' "
                                    "to emulate its rounding")
        n = precision.lower(captured.graph_module, opts.auto_cast, opts.auto_cast_type)
        return {"auto_cast": opts.auto_cast, "type": opts.auto_cast_type, "emulated": False,
                "ops_lowered": n, "note": f"{n} op(s) computed in {opts.auto_cast_type} on the GPU"}
    if precision.native(opts.auto_cast_type) and opts.engine in (None, "openvino") \
            and backends.get("openvino", required=False) is not None:
        opts.engine = "openvino"   # the engine that computes bf16/fp16 natively on CPUs
        return {"auto_cast": opts.auto_cast, "type": opts.auto_cast_type, "emulated": False,
                "note": f"{opts.auto_cast_type} computed natively by OpenVINO"}
    n = precision.emulate(captured.graph_module, opts.auto_cast, opts.auto_cast_type)
    note = (f"{opts.auto_cast_type} is emulated: inputs of {n} op(s) are rounded to "
            f"{opts.auto_cast_type} and computed in fp32, to show its accuracy, not to gain speed")
    notes.append(note)
    warnings.warn(f"kiln: {note}", stacklevel=3)
    return {"auto_cast": opts.auto_cast, "type": opts.auto_cast_type, "emulated": True,
            "ops_rounded": n, "note": note}


def _errors(pair):
    expected, actual = pair
    diffs = [(e.double() - a.double()).abs().max().item() for e, a in zip(expected, actual)
             if e.is_floating_point() and e.numel()]
    return {"max_abs_error": max(diffs, default=0.0)}
