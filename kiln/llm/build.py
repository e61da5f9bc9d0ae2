"""Compile a Hugging Face decoder into a :class:`kiln.runtime.llm.LLM`: a prefill graph
per context bucket, a decode graph per decode batch size and, for speculative decoding,
a verify graph, each through :func:`kiln.trace` (so engine choice, the compile cache and
the accuracy check against eager apply as for any model); quantized builds then pass the
LLM accuracy gate (:mod:`kiln.llm.gate`).
"""
from __future__ import annotations

import numbers
import os
import shlex
import tempfile
import time

import torch

from kiln.compiler import selection
from kiln.compiler.api import trace
from kiln.engines import onnx_model, ort_once
from kiln.errors import CompilerArgsError, ValidationError
from kiln.llm import cuda, gate, gguf_keep, parallel
from kiln.llm.decoder import DecoderStep, cache_shape, check_supported, max_positions
from kiln.runtime import hf_settings
from kiln.runtime.llm import FORMAT, LLM


def compile_llm(model, *, batch_size: int = 1, context_buckets=(64,), cache_length: int = 128,
                decode_batches=None, speculation_length=None, tokenizer=None, on_graph=None,
                max_ppl_ratio=None, min_agreement=None, workers=None, prefill_chunk=None,
                sequence_buckets=None, tp_degree: int = 1, prefill_auto_cast=None, **trace_options) -> LLM:
    """``model``: a ``*ForCausalLM`` of the Llama family, or GPT-2. ``batch_size``: requests generating
    at once (KV-cache rows). ``decode_batches``: the decode graphs' batch sizes (default 1
    and ``batch_size``: a lone stream runs the 1-row graph). ``context_buckets``: the prompt
    widths prefill is compiled for (batch 1; a prompt runs in the smallest that fits);
    ``cache_length``: KV-cache positions, prompt plus generated tokens. ``tokenizer``: a
    Hugging Face tokenizer stored in the artifact. ``on_graph(name, index, count, seconds)``
    is called after each graph is compiled (progress for the command line). ``workers``:
    processes compiling graphs side by side (:mod:`kiln.llm.parallel`; default one per graph,
    up to two per CPU, for models of 20M parameters or more, quantized or on 4 CPUs or more;
    else 1, in this process).
    ``speculation_length=k`` adds the graph speculative decoding verifies ``k`` draft
    tokens with (:mod:`kiln.runtime.speculative`). ``prefill_chunk=c`` adds a graph that
    prefills ``c`` prompt tokens of one row against its cache: the scheduler then prefills
    long prompts a chunk per step between decode steps, and prompts longer than the
    largest context bucket run (up to the cache). ``sequence_buckets``: smaller cache
    windows to compile the decode (and chunk) graphs for as well, so that steps attend
    over the smallest window holding the running sequences rather than all
    ``cache_length`` positions (:mod:`kiln.runtime.kv`); each window adds a graph per
    decode batch size.
    ``quantize="int8"`` or ``"int4"`` (weight-only: ``quantize_mode="weight_only"`` is
    implied for LLMs) must pass :mod:`kiln.llm.gate`, perplexity within ``max_ppl_ratio``
    of float32's and greedy agreement of at least ``min_agreement`` (defaults per mode in
    ``gate.LIMITS``), or compiling fails with the numbers. ``quantize="gguf"`` keeps the
    blocks of the GGUF file the model was loaded from (:mod:`kiln.llm.gguf_keep`; the
    artifact's manifest says per tensor how, under ``llm.gguf``). ``tp_degree=N`` shards the
    model over N ranks (:mod:`kiln.llm.tp`) and returns a
    :class:`~kiln.runtime.tp_llm.TensorParallelLLM`. ``prefill_auto_cast="bf16"`` (quantized
    builds, on a CPU that computes bf16 natively) compiles the prefill graphs to compute in
    bf16, as OpenVINO GenAI does by default on such CPUs: on a 2-core Xeon with AMX SmolLM2
    int4's first token came in 0.053 s instead of 0.079 (docs/llm.md); the accuracy gate judges the whole
    build, and prefill runs one request at a time, so batching still never changes an answer.
    Other keywords go to ``kiln.trace``."""
    family = check_supported(model)
    cuda.check_options(trace_options, tp_degree)
    batch_size = _positive_int("batch_size", batch_size)
    cache_length = _positive_int("cache_length", cache_length)
    speculation_length, prefill_chunk = _optional_sizes(speculation_length, prefill_chunk)
    workers = None if workers is None else _positive_int("workers", workers)
    _check_gate_limits(max_ppl_ratio, min_agreement, trace_options.get("quantize"))
    if trace_options.get("quantize") not in (None, "none") and cache_length < 3:
        # until 12-03 every graph was compiled first, and the gate then failed with torch's own error
        raise CompilerArgsError(f"cache_length={cache_length} with quantize={trace_options['quantize']!r}: the "
                                "accuracy gate a quantized build must pass measures at least 2 tokens against "
                                "float32, so cache_length must be at least 3")
    if tp_degree != 1:
        return _compile_tp(model, tp_degree, locals())
    buckets, rows = _shapes(model, batch_size, context_buckets, cache_length, decode_batches)
    model = model.eval()
    shape = cache_shape(model.config, batch_size, cache_length)
    quantize = trace_options.get("quantize")
    if quantize:
        trace_options.setdefault("quantize_mode", "weight_only")
        # the LLM-level gate below judges accuracy; the per-graph cosine on one example is a floor
        trace_options.setdefault("min_cosine", 0.9)
    _check_prefill_cast(prefill_auto_cast, quantize, trace_options)
    jobs, keys, windows = _jobs(shape, buckets, rows, speculation_length, prefill_chunk,
                                sequence_buckets)
    kept = _gguf_plan(model, trace_options)
    with gguf_keep.keeping(model, kept):
        graphs = _compile_graphs(model, jobs, trace_options, workers, on_graph, prefill_auto_cast)
    built: dict = {}
    for (kind, key), graph in zip(keys, graphs):
        built.setdefault(kind, {})[key] = graph
    meta = _meta(model, family, batch_size, rows, buckets, speculation_length, prefill_chunk, windows, shape)
    llm = _assemble(built, meta, windows, tokenizer)
    if decode_batches is None and _lone_row_dropped(llm, batch_size):
        with gguf_keep.keeping(model, kept):
            _add_pair_graphs(model, built, shape, speculation_length, sequence_buckets,
                             (trace_options, workers, on_graph, prefill_auto_cast))
        meta["decode_batches"] = sorted(set(rows) | {2})
        llm = _assemble(built, meta, windows, tokenizer)
    if kept is not None:
        meta["gguf"] = kept.manifest()
    if quantize:
        meta["accuracy_gate"] = _gate(model, llm, tokenizer, quantize, max_ppl_ratio, min_agreement)
    return llm


def _meta(model, family, batch_size, rows, buckets, speculation_length, prefill_chunk, windows, shape) -> dict:
    eos = model.generation_config.eos_token_id
    return {"format": FORMAT, "family": family, "batch_size": batch_size, "decode_batches": rows,
            "context_buckets": buckets, "speculation_length": speculation_length,
            "prefill_chunk": prefill_chunk or None, "sequence_buckets": windows,
            "cache_shape": list(shape), "vocab_size": model.config.vocab_size,
            "eos_token_ids": [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            # generate's defaults, as transformers' generate takes them from model.generation_config
            "generation_config": hf_settings.recorded(model.generation_config)}


def _assemble(built: dict, meta: dict, windows: list, tokenizer) -> LLM:
    window_graphs = {w: {"decode": built[("window", w, "decode")],
                         "chunk": built.get(("window", w, "chunk"), {}).get(0)} for w in windows[:-1]}
    return LLM(built["prefill"], built["decode"], meta, _tokenizer_files(tokenizer),
               verify=built.get("verify"), chunk=built.get("chunk", {}).get(0), windows=window_graphs)


def _lone_row_dropped(llm: LLM, batch_size: int) -> bool:
    """Whether the batch-invariance check (:mod:`kiln.runtime.invariance`, run here on the
    compiling machine) dropped the 1-row decode graph while a 2-row graph would still be
    smaller than the others. Then a 2-row graph is compiled too, and a lone stream runs it:
    SmolLM2 int4 on a 2-core AVX2 EPYC (12-02), 18.1 tok/s through the 8-row graph, 33.6
    through a 2-row one, which computes a row as the 8-row graph does (43.6 through the
    1-row graph, which does not). An artifact loaded elsewhere is checked again there."""
    report = llm.batch_invariance
    return batch_size > 2 and 1 in report["dropped"] and not report["row_by_row"]


def _add_pair_graphs(model, built: dict, shape, speculation_length, sequence_buckets, how) -> None:
    """The 2-row decode graphs (full cache, each window, verify) into ``built``: this
    machine's kernels compute one row differently from several (:func:`_lone_row_dropped`)."""
    jobs, keys, _ = _jobs(shape, [], [2], speculation_length, None, sequence_buckets)
    more = [(job, key) for job, key in zip(jobs, keys) if key[1] not in built.get(key[0], {})]
    graphs = _compile_graphs(model, [job for job, _ in more], *how)
    for (_, (kind, key)), graph in zip(more, graphs):
        built.setdefault(kind, {})[key] = graph


def _shapes(model, batch_size, context_buckets, cache_length, decode_batches) -> tuple:
    """``(context buckets, decode batch sizes)``, sorted, or a clear error."""
    limit = max_positions(model.config)
    if limit is not None and cache_length > limit:
        raise CompilerArgsError(f"cache_length={cache_length} exceeds the {limit} positions {type(model).__name__} "
                                f"has learned position embeddings for; use cache_length <= {limit}")
    buckets = sorted({_positive_int("a context bucket", w) for w in _sizes("context_buckets", context_buckets)})
    if not buckets:
        raise CompilerArgsError("give at least one context bucket")
    rows = sorted({1, batch_size} if decode_batches is None
                  else {_positive_int("a decode batch", b) for b in _sizes("decode_batches", decode_batches)}
                  | {batch_size})
    if rows[0] < 1 or rows[-1] > batch_size:
        raise CompilerArgsError(f"decode_batches must lie in [1, batch_size={batch_size}]; got {decode_batches}")
    if buckets[-1] > cache_length:
        raise CompilerArgsError(f"context bucket {buckets[-1]} exceeds cache_length={cache_length}: "
                                "the prompt's keys must fit in the cache")
    return buckets, rows


def _sizes(name, values) -> list:
    """A list of sizes given as a list or tuple (a bare int was a raw TypeError)."""
    if not isinstance(values, (list, tuple, range)):
        raise CompilerArgsError(f"{name} must be a list of sizes, such as ({values!r},); got {values!r}")
    return list(values)


def _positive_int(name, value) -> int:
    """``value`` as an int, or CompilerArgsError where it is not a positive integer (a
    float ``batch_size`` was a raw TypeError, a float bucket cut to an int)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise CompilerArgsError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _optional_sizes(*values) -> list:
    """``speculation_length`` and ``prefill_chunk``: None (the default: no such graph) or a
    positive integer, as ints; 0 compiled nothing and said nothing, while -1 was an error."""
    out = []
    for name, value in zip(("speculation_length", "prefill_chunk"), values):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
            raise CompilerArgsError(f"{name} must be a positive integer, or None (the default) for none; got "
                                    f"{value!r}")
        out.append(None if value is None else int(value))
    return out


def _compile_graphs(model, jobs, trace_options, workers, on_graph, prefill_auto_cast=None) -> list:
    # each graph holds every weight: quantized once for the graphs this process compiles
    with onnx_model.decoder_graphs(), ort_once.sharing():
        return _compile_jobs(model, jobs, trace_options, workers, on_graph, prefill_auto_cast)


def _compile_jobs(model, jobs, trace_options, workers, on_graph, prefill_auto_cast) -> list:
    workers = (parallel.default_workers(model, len(jobs), quantized=bool(trace_options.get("quantize")))
               if workers is None else int(workers))
    per_job = graph_options(jobs, trace_options)
    if prefill_auto_cast:
        per_job = [_auto_cast(o, prefill_auto_cast) if name.startswith("prefill") else o
                   for (name, _, _), o in zip(jobs, per_job)]
    graphs = parallel.compile_graphs(model, jobs, per_job, workers, on_graph) if workers > 1 else None
    if graphs is None:
        graphs = []
        for k, (name, step_kwargs, example) in enumerate(jobs):
            started = time.perf_counter()
            graphs.append(trace(DecoderStep(model, **step_kwargs).eval(), example, **per_job[k]))
            if on_graph is not None:
                on_graph(name, k + 1, len(jobs), time.perf_counter() - started)
    return graphs


def _auto_cast(options: dict, cast: str) -> dict:
    """``options`` with ``--auto-cast all --auto-cast-type cast`` added to its compiler flags."""
    flags = ["--auto-cast", "all", "--auto-cast-type", cast]
    given = options.get("compiler_args") or []
    return dict(options, compiler_args=(shlex.split(given) if isinstance(given, str) else list(given)) + flags)


def _check_gate_limits(max_ppl_ratio, min_agreement, quantize) -> None:
    """The accuracy gate's limits, checked before anything compiles: a limit no build can
    meet (an agreement over 100 %, a ratio of 0 or NaN) failed only after minutes of
    compiling, and limits given for a float build, which has no gate, were ignored."""
    given = [name for name, v in (("max_ppl_ratio", max_ppl_ratio), ("min_agreement", min_agreement))
             if v is not None]
    if given and not quantize:
        raise CompilerArgsError(f"{' and '.join(given)} limit the accuracy gate of quantized builds (quantize="
                                "'int8', 'int4' or 'gguf'); a float build has no gate")
    if max_ppl_ratio is not None and (not isinstance(max_ppl_ratio, numbers.Real) or isinstance(max_ppl_ratio, bool)
                                      or not max_ppl_ratio > 0):
        raise CompilerArgsError(f"max_ppl_ratio is the largest perplexity allowed over float32's, a number above 0 "
                                f"(1.25 allows 25 % more); got {max_ppl_ratio!r}")
    if min_agreement is not None and (not isinstance(min_agreement, numbers.Real) or isinstance(min_agreement, bool)
                                      or not 0 <= min_agreement <= 1):
        raise CompilerArgsError(f"min_agreement is the share of positions whose greedy token must equal float32's, "
                                f"from 0 to 1 (0.75 for 75 %); got {min_agreement!r}")


def _check_prefill_cast(cast, quantize, trace_options) -> None:
    """``prefill_auto_cast``: bf16, for a quantized build (whose accuracy gate then judges it;
    quantized LLMs are CPU builds, :func:`kiln.llm.cuda.check_options`), on a CPU that computes
    bf16 natively (elsewhere kiln would only emulate it: slower)."""
    if cast is None:
        return
    from kiln.host import target
    if cast != "bf16":
        raise CompilerArgsError(f"prefill_auto_cast={cast!r}: only 'bf16' is supported")
    if not quantize:
        raise CompilerArgsError("prefill_auto_cast applies to quantized builds (quantize='int8', 'int4' or "
                                "'gguf'), whose accuracy gate judges it; a float build has no gate to")
    if not target.native("bf16"):
        raise CompilerArgsError("prefill_auto_cast='bf16': this CPU does not compute bf16 natively (it needs "
                                "AVX512-BF16 or AMX), so kiln could only emulate it, more slowly: drop it")


def graph_options(jobs, trace_options) -> list:
    """Each graph's ``kiln.trace`` options. A quantized model's prefill graphs go to whichever
    engine that quantizes them measures fastest (:func:`kiln.compiler.selection.times_quantizers`);
    the graphs a batch's rows run through (decode, verify, chunk, windows) all take one
    engine, the first in the default order that quantizes, unless the user named one. Two
    engines round differently, and a row must get the same answer whatever the batch
    holds (:mod:`kiln.runtime.invariance`). Measured on SmolLM2 int8, 2 cores, per graph:
    prefill (128 tokens) ONNX Runtime 164 ms, OpenVINO 84; decode, 1 row, 9.2 and 12.8 ms;
    8 rows, 66.0 and 39.7 ms. Timed one by one, the 1-row graph went to ONNX Runtime and the
    8-row graph to OpenVINO; the invariance probe then dropped the 1-row graph, and a lone
    stream ran on the 8-row one at 36 tok/s instead of ~110 (docs/performance.md)."""
    if not trace_options.get("quantize") or trace_options.get("engine"):
        return [trace_options] * len(jobs)
    rows_engine = dict(trace_options, engine=selection.default_quantizer(
        trace_options["quantize"], trace_options.get("quantize_mode", "weight_only")))
    return [trace_options if name.startswith("prefill") else rows_engine for name, _, _ in jobs]


def _gguf_plan(model, trace_options):
    """``quantize="gguf"``: the model's GGUF file's own blocks wherever a kernel takes them,
    float where the file holds float (:mod:`kiln.llm.gguf_keep`); a matrix the file does not
    hold (none, for a model loaded from it) gets int8. The graphs' cache entries are named
    by the blocks, apart from plain int8 ones."""
    if trace_options.get("quantize") != "gguf":
        return None
    kept = gguf_keep.plan(model, gguf_keep.source_path(model, "gguf"))
    trace_options.update(quantize="int8", name=f"DecoderStep, GGUF blocks {kept.digest}")
    return kept


def _compile_tp(model, tp_degree, args):
    from kiln.llm.tp import compile_tp
    if not isinstance(tp_degree, int) or tp_degree < 1:
        raise CompilerArgsError(f"tp_degree must be a positive integer; got {tp_degree!r}")
    if args["speculation_length"]:      # refused before its verify graphs take a minute to compile
        raise CompilerArgsError(f"speculation_length={args['speculation_length']} with tp_degree={tp_degree}: "
                                "speculative decoding does not run tensor-parallel LLMs yet (their verify "
                                "graphs could never run); compile without speculation_length, or at tp_degree=1")
    options = {k: args[k] for k in ("batch_size", "context_buckets", "cache_length", "decode_batches",
                                    "speculation_length", "prefill_chunk", "sequence_buckets", "prefill_auto_cast")}
    options.update(args["trace_options"])
    tokenizer = args["tokenizer"]
    return compile_tp(model, tp_degree, compile_llm, tokenizer_files=_tokenizer_files(tokenizer),
                      on_graph=args["on_graph"], **options)


def _jobs(shape, buckets, rows, speculation_length, prefill_chunk, sequence_buckets) -> tuple:
    """``(jobs, keys, windows)``: each graph to compile as ``(name, DecoderStep options,
    example)``, the ``(kind, key)`` it is filed under, and the cache windows."""
    cache_length = shape[3]
    prefill_step, decode_step = {"with_cache": False, "last_only": True}, {"with_cache": True, "last_only": False}
    jobs = [(f"prefill {w}", prefill_step, _prefill_example(w)) for w in buckets]
    jobs += [(f"decode {b}x{cache_length}", decode_step, _decode_example(shape, b)) for b in rows]
    verify_rows = _verify_rows(rows) if speculation_length else []
    jobs += [_verify_job(shape, speculation_length, b) for b in verify_rows]
    if prefill_chunk:
        if not 1 <= prefill_chunk < cache_length:
            raise CompilerArgsError(f"prefill_chunk must be in [1, cache_length); got {prefill_chunk}")
        jobs.append((f"chunk {prefill_chunk}", decode_step, _decode_example(shape, 1, prefill_chunk)))
    windows = _windows(sequence_buckets, cache_length)
    keys = [("prefill", w) for w in buckets] + [("decode", b) for b in rows]
    keys += [("verify", b) for b in verify_rows] + [("chunk", 0)] * bool(prefill_chunk)
    for window in windows[:-1]:
        small = (*shape[:3], window, shape[4])
        jobs += [(f"decode {b}x{window}", decode_step, _decode_example(small, b)) for b in rows]
        keys += [(("window", window, "decode"), b) for b in rows]
        if prefill_chunk and window > prefill_chunk:
            jobs.append((f"chunk {prefill_chunk}x{window}", decode_step, _decode_example(small, 1, prefill_chunk)))
            keys.append((("window", window, "chunk"), 0))
    return jobs, keys, windows


def add_verify(model, llm: LLM, speculation_length: int, **trace_options) -> LLM:
    """``llm`` (compiled from ``model``) with verify graphs for ``speculation_length``
    draft tokens (one per decode batch size, :func:`_verify_rows`), compiling only those:
    for a target compiled before it was known to need speculative decoding
    (transformers-neuronx's ``FusedSpeculativeDecoder``)."""
    check_supported(model)
    verify = {}
    for rows in _verify_rows(llm.decode):
        _, step_kwargs, example = _verify_job(tuple(llm.meta["cache_shape"]), speculation_length, rows)
        with onnx_model.decoder_graphs():
            verify[rows] = trace(DecoderStep(model.eval(), **step_kwargs).eval(), example, **trace_options)
    meta = {**llm.meta, "speculation_length": speculation_length}
    return LLM(llm.prefill, llm.decode, meta, llm.tokenizer_files, verify=verify, chunk=llm.chunk,
               windows=llm.windows)


def _windows(sequence_buckets, cache_length) -> list:
    given = _sizes("sequence_buckets", sequence_buckets) if sequence_buckets is not None else []
    windows = sorted({_positive_int("a sequence bucket", w) for w in given} | {cache_length})
    if windows[0] < 1 or windows[-1] > cache_length:
        raise CompilerArgsError(f"sequence_buckets must lie in [1, cache_length={cache_length}]; got "
                                f"{list(sequence_buckets)}")
    return windows


def _verify_rows(decode_rows) -> list:
    """The verify graphs' batch sizes: one row (the single-stream
    :class:`~kiln.runtime.speculative.SpeculativeDecoder`'s) and every decode batch size,
    so that the scheduler verifies its running rows in one call, as it decodes them."""
    return sorted({1, *decode_rows})


def _verify_job(shape, speculation_length, rows=1):
    """The verify graph for ``rows`` rows of ``k + 1`` tokens each: the decode step at
    ``[rows, k + 1]``. Each row's positions and valid cache slots are its own inputs, so
    every row of one call sits at its own cache position (:mod:`kiln.runtime.spec_step`)."""
    if not isinstance(speculation_length, int) or not 1 <= speculation_length < shape[3]:
        raise CompilerArgsError(f"speculation_length must be in [1, cache_length={shape[3]}); got "
                                f"{speculation_length}")
    name = f"verify {speculation_length + 1}" if rows == 1 else f"verify {rows}x{speculation_length + 1}"
    return (name, {"with_cache": True, "last_only": False},
            _decode_example(shape, rows, speculation_length + 1))


def _gate(model, llm, tokenizer, quantize, max_ppl_ratio, min_agreement) -> dict:
    limits = gate.LIMITS.get(quantize, gguf_keep.LIMITS)
    limits = (limits[0] if max_ppl_ratio is None else max_ppl_ratio,
              limits[1] if min_agreement is None else min_agreement)
    shape = llm.meta["cache_shape"]
    ids = gate.gate_ids(tokenizer, model.config.vocab_size, min(64, shape[3] - 1))
    reference = DecoderStep(model, with_cache=False, last_only=False).eval()
    rows = min(llm.decode)
    result = gate.measure(reference, (llm.prefill_for(1), llm.decode[rows]), ids, shape, limits, rows)
    if not result.passed:
        raise ValidationError(f"the {quantize} model fails the accuracy gate: {result.describe()}. Relax "
                              "it (max_ppl_ratio=, min_agreement=) or keep more precision"
                              + (" (int8)" if quantize == "int4" else " (no quantize)"))
    return result.to_dict()


def _prefill_example(width):
    """One prompt: the scheduler prefills each request alone as it joins the batch."""
    return (torch.zeros(1, width, dtype=torch.int64), torch.arange(width).unsqueeze(0), torch.tensor([width - 1]))


def _decode_example(shape, rows, tokens=1):
    layers, _, heads, slots, dim = shape
    valid = torch.zeros(rows, slots, dtype=torch.bool)
    valid[:, : slots // 2] = True
    cache = [torch.zeros(rows, heads, slots, dim) for _ in range(2 * layers)]
    positions = (slots // 2 + torch.arange(tokens)).repeat(rows, 1)
    return (torch.zeros(rows, tokens, dtype=torch.int64), positions, *cache, valid)


def _tokenizer_files(tokenizer) -> dict:
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="kiln-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        out = {}
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                out[name] = f.read()
        return out
