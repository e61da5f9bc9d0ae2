"""``kiln.trace`` and ``kiln.analyze``: the compiler's front door.

Options are parsed here, once per call, into a frozen ``CompileOptions``; the compile
cache or parallel-compile's collect pass is chosen here and handed to the driver as
its hook; shape adapters (buckets, dynamic batch, pipeline stages) are planned here
around the driver's one-graph compile, and proved not to change answers
(:mod:`kiln.compiler.padcheck`).
"""
from __future__ import annotations

import torch

from kiln.compiler import cache as cache_mod
from kiln.compiler import collect, padcheck
from kiln.compiler.caching import CacheHook
from kiln.compiler.driver import OPTION_FIELDS, GraphJob, make_options, run_job
from kiln.compiler.phases import plan
from kiln.errors import CompilerArgsError
from kiln.graph import randomness
from kiln.graph.analysis import AnalysisReport
from kiln.graph.capture import capture
from kiln.progress import Progress


def analyze(model, example_inputs=None, example_kwargs=None, *, engine=None, device=None,
            compiler_args=None, min_partition_size=None, ops_on_host=None, quiet=None) -> AnalysisReport:
    """Report op support and the partitioning a trace would use, without compiling."""
    opts = make_options(compiler_args, engine=engine, device=device, min_partition_size=min_partition_size,
                        ops_on_host=ops_on_host)
    progress = Progress(quiet=quiet)
    with progress.phase("capture"), randomness.unchanged():      # its eager run draws nothing of the caller's
        captured = capture(model, example_inputs, example_kwargs)
    return plan(captured, opts, progress).report


def trace(model, example_inputs=None, example_kwargs=None, *, buckets=None, pad_values=None,
          output_dims=None, dynamic_batch=False, pipeline_cores=None, compiler_args=None,
          quiet=None, cache=None, retry_failed=False, **options):
    """Compile ``model`` ahead of time for this machine and return the loaded result.

    ``example_inputs`` is a tensor, a tuple of positional inputs or a dict of
    keyword inputs (``example_kwargs`` adds keywords to positional ones).
    ``quantize="int8"`` quantizes weights (``quantize_mode="dynamic"``, the
    default without data) or weights and activations calibrated on
    ``calibration_data``, an iterable of example inputs (``"static"``, the
    default with data); ``quantize_mode="weight_only"`` keeps activations in float
    with int8 weights per output channel, and ``quantize="int4"`` (weight-only
    always) stores weights as int4 in groups of 32 (ONNX Runtime's MatMulNBits);
    the result must pass ``min_cosine``/``min_top1``.

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
    settings = {k: options.pop(k) for k in ("threads", "name", "calibration_data") if k in options}
    unknown = sorted(set(options) - set(OPTION_FIELDS))
    if unknown:
        raise TypeError(f"trace() got unexpected keyword argument(s): {', '.join(unknown)}")
    calibration = _samples(settings.get("calibration_data"))
    if options.get("quantize") and options.get("quantize_mode") is None:
        options["quantize_mode"] = ("weight_only" if options["quantize"] == "int4" else
                                    "static" if calibration else "dynamic")
    opts = make_options(compiler_args, **options)          # parsed once, frozen
    progress = Progress(quiet=quiet)
    store = cache_mod.open_cache(cache)
    hook = None
    if store is not None:
        directory = collect.collecting()
        hook = (collect.collect_hook(store, directory, progress) if directory else
                CacheHook(store, retry_failed, progress))

    def trace_one(m, args, kwargs, label=None):
        job = GraphJob(m, args, kwargs, opts, compiler_args, settings.get("name"),
                       settings.get("threads"), calibration, label)
        return run_job(job, hook, progress)

    pipeline_cores = opts.pipeline_cores if pipeline_cores is None else pipeline_cores
    # compiling runs the model and its builds (eager's reference, checks, timing): the
    # random numbers they draw are not the caller's (kiln.graph.randomness)
    with randomness.unchanged():
        if store is not None and collect.collecting():
            return collect.collect_trace(model, example_inputs, example_kwargs, buckets, pad_values,
                                         pipeline_cores, trace_one)
        compiled = _shaped(model, example_inputs, example_kwargs, buckets, pad_values, output_dims,
                           pipeline_cores, calibration, trace_one, opts, progress)
        tol = padding_tolerance(opts, compiled)
        if dynamic_batch:
            from kiln.runtime.buckets import DynamicBatch
            compiled = DynamicBatch(compiled)
            padcheck.settle_rows(compiled)
            if tol is not None:
                with progress.phase("batch check"):
                    compiled.manifest["batch_check"] = padcheck.check_dynamic_batch(
                        model, compiled, example_inputs, example_kwargs, tol)
            else:
                compiled.manifest["batch_check"] = {"skipped": "validate=False"}
        elif tol is not None:
            # dynamic_batch() and DataParallel split batches without the eager model: they split
            # only a model this proves row-independent (kiln.runtime.synthetic_rows.proven_rows)
            with progress.phase("row check"):
                compiled.manifest["row_check"] = padcheck.check_rows(model, compiled, example_inputs,
                                                                     example_kwargs, tol)
    return compiled


def _samples(calibration) -> tuple:
    """``calibration_data`` as a tuple of samples (a tensor given alone was torch's "Boolean
    value of Tensor ... is ambiguous" until 12-03)."""
    if isinstance(calibration, (torch.Tensor, dict)) or (calibration is not None
                                                          and not hasattr(calibration, "__iter__")):
        raise CompilerArgsError("calibration_data must be a list of samples, each one call's example inputs (a "
                                "tensor, a tuple or a dict): e.g. calibration_data=[x1, x2]")
    return tuple(calibration or ())


def _shaped(model, example_inputs, example_kwargs, buckets, pad_values, output_dims, pipeline_cores,
            calibration, trace_one, opts, progress):
    """One graph, one per bucket, or one per pipeline stage."""
    if pipeline_cores and pipeline_cores > 1:
        if buckets is not None:
            raise CompilerArgsError("pipeline_cores and buckets cannot be combined yet; "
                                    "compile one pipeline per shape")
        if calibration:
            raise CompilerArgsError("static quantization (calibration_data=) cannot be combined "
                                    "with pipeline_cores yet: the samples are the model's inputs, "
                                    "not each stage's; use quantize_mode='dynamic'")
        from kiln.compiler.stages import trace_pipeline
        return trace_pipeline(model, example_inputs, example_kwargs, pipeline_cores, trace_one, progress)
    if buckets is not None:
        from kiln.compiler.buckets import bucket_examples, trace_buckets
        examples = bucket_examples(model, example_inputs, example_kwargs, buckets, pad_values)
        compiled = trace_buckets(model, examples, pad_values, output_dims, trace_one)
        tol = padding_tolerance(opts, compiled)
        if tol is not None:
            with progress.phase("padding check"):
                compiled.manifest["padding_check"] = padcheck.check_buckets(model, compiled, examples, tol)
        return compiled
    if pad_values or output_dims:
        raise CompilerArgsError("pad_values and output_dims apply to buckets; pass buckets= too")
    return trace_one(model, example_inputs, example_kwargs)


def padding_tolerance(opts, compiled=None):
    """How closely padded and chunked answers must match eager (None: validate=False).
    Lossy compiles are held to their accuracy gate, not to atol; GPU builds checked at TF32
    (kiln.graph.validation) to TF32's precision, as their unpadded answers were."""
    if not opts.validate:
        return None
    if opts.quantize or (opts.auto_cast != "none" and opts.auto_cast_type not in ("fp32", "tf32")):
        return padcheck.Tolerance(min_cosine=opts.min_cosine)
    return padcheck.Tolerance(opts.atol, opts.rtol, precision="tf32" if _checked_at_tf32(compiled) else None)


def _checked_at_tf32(compiled) -> bool:
    if compiled is None:
        return False
    if (getattr(compiled, "manifest", None) or {}).get("validation", {}).get("precision") == "tf32":
        return True
    inner = compiled.inner_models() if hasattr(compiled, "inner_models") else ()
    return any(_checked_at_tf32(m) for m in inner)
