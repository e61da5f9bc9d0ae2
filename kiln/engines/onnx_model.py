"""A partition as an ONNX model (torch's exporter, kiln's rewrites, ONNX Runtime's quantization
tools), shared by the engines that run ONNX: ONNX Runtime, and OpenVINO for weight-only
quantized partitions (its ONNX frontend reads ``MatMulNBits`` as compressed weights).

A quantized partition is timed on each engine that quantizes it (:mod:`kiln.compiler.selection`),
and the export and quantization are the slow part of a build (SmolLM2-135M's prefill graph:
about 4 s to export and 6 s to quantize), so the second engine takes the first one's model:
the last weight-only model of each partition is kept while the partition lives.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import threading
import weakref

import torch

from kiln.engines import ort_export, ort_quantize, ort_rewrites
from kiln.quiet import quiet

# The ONNX opset partitions are exported at. From opset 23 torch's exporter writes
# ``scaled_dot_product_attention`` as ONNX's fused ``Attention`` op, which ONNX Runtime
# runs as one kernel (fully masked rows give zeros, as torch does); at the exporter's
# default (18) it is a dozen ops that no ORT fusion recognises. Measured on the 2-core
# AVX2 machine (docs/performance.md): all-MiniLM-L6-v2 seq 128 26.1 -> 23.9 ms, BERT-base
# 156.8 -> 151.7 ms; and ORT's own session fusions then find SkipLayerNormalization and
# Gelu without help.
EXPORT_OPSET = 23

# The exporter's own optimizer (onnxscript's rewriter) costs time that grows faster than
# the graph: 42 s of a 65 s compile for SmolLM2's 30-layer decode step (2,524 ops), with
# the same step time without it (35.1 vs 35.2 ms), since the session's optimizer folds
# and fuses the graph anyway. Larger partitions skip it; BERT-base (~540 ops) keeps it.
EXPORTER_OPTIMIZE_MAX_OPS = 1500

# An LLM's step graphs (decoder_graphs) skip that optimizer at any size: kiln's own rewrites
# and decoder fusions (ort_rewrites, ort_decoder) are written for the graph without it, which
# is what a real LLM's graphs get above the limit. A small one's (the tests' 2-layer Llama)
# went through the optimizer, another path than users' models take; without it the tests'
# windowed Llama build (7 graphs) took 12.0-15.0 s against 17.3-17.4 s, the same tokens, no slower
# (2 cores, alternating builds). Other models keep it: BERT-base ran 149 -> 164 ms without.
_DECODER = threading.local()

_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # partition -> {key: (bytes, settings)}
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def registry():
    # torchvision ops are optional in the registry; its absence is not news.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    # the opset kiln exports at: one registry serves both the support check and the export
    return ort_export.registry_for(EXPORT_OPSET)


_REUSE = threading.local()    # .memo: {partition key: (serialized model, settings)} in a reuse block


@contextlib.contextmanager
def reusing_exports():
    """Within the block, a partition exported once is not exported again: the next engine
    or build (another precision of the same model, :func:`kiln.compiler.reuse_captures`)
    gets its own copy of the model, parsed from the kept bytes (0.1 s for one of SmolLM2's
    540 MB graphs, against 7-8 s of export, plus about 1 s to keep them on the first
    build). A partition is the same when its code, its inputs' shapes and dtypes and its
    weights' contents are."""
    outer = getattr(_REUSE, "memo", None)
    if outer is None:
        _REUSE.memo = {}
    try:
        yield
    finally:
        if outer is None:
            _REUSE.memo = None


@contextlib.contextmanager
def decoder_graphs():
    """Within the block (this thread), partitions are exported as an LLM's step graphs: without
    the exporter's optimizer whatever their size (see ``_DECODER`` above)."""
    outer = getattr(_DECODER, "on", False)
    _DECODER.on = True
    try:
        yield
    finally:
        _DECODER.on = outer


def _reuse_key(partition, example_inputs):
    """The partition's code, its inputs' shapes and dtypes, and its weights by content
    (XXH3: tens of milliseconds for 500 MB; identity or ``_version`` would miss a write
    through ``param.data``)."""
    import xxhash
    weights = xxhash.xxh3_128()
    for node in partition.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(partition)
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return None
            value = value.detach().contiguous()
            weights.update(f"{node.target}{value.dtype}{tuple(value.shape)}".encode())
            if value.numel():
                weights.update(value.view(-1).view(torch.uint8).numpy().data)
    inputs = tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                   for t in example_inputs)
    return partition.code, inputs, weights.hexdigest()


def _kept(partition, example_inputs) -> tuple:
    """``(key, (bytes, settings) or None)``: the partition's key in this block's memo (None
    outside a :func:`reusing_exports` block) and what the block keeps for it."""
    memo = getattr(_REUSE, "memo", None)
    key = _reuse_key(partition, example_inputs) if memo is not None else None
    return key, (memo.get(key) if key is not None else None)


def _keep(key, data, settings):
    if key is not None and data is not None:     # over protobuf's 2 GB: exported again next time
        _REUSE.memo[key] = (data, dict(settings))


def exported(partition, example_inputs) -> tuple:
    """``(model proto, settings)``: the partition exported and rewritten
    (:mod:`kiln.engines.ort_rewrites`); ``settings`` say how, for the blob's header.
    Each call's model is its own (quantization rewrites it in place)."""
    key, kept = _kept(partition, example_inputs)
    if kept is not None:
        import onnx
        proto = onnx.ModelProto()
        proto.ParseFromString(kept[0])
        return proto, dict(kept[1])
    proto, settings = _export(partition, example_inputs)
    if key is not None:
        _keep(key, ort_quantize.serialized(proto), settings)
    return proto, settings


def exported_file(partition, example_inputs, path: str) -> tuple:
    """``(path, settings)``: the partition's model, as :func:`exported` gives it, written to
    ``path`` for an engine that reads it unchanged (ONNX Runtime's float build). The model is
    serialized once: the bytes kept for the next build of the block are the bytes written
    (each serialization of SmolLM2's 540 MB graph cost 1.2 s, two per graph before)."""
    key, kept = _kept(partition, example_inputs)
    if kept is not None:
        data, settings = kept
    else:
        proto, settings = _export(partition, example_inputs)
        data = ort_quantize.serialized(proto)
        if data is None:                 # over protobuf's 2 GB: weights beside the file
            return ort_quantize.save(proto, path), settings
        _keep(key, data, settings)
    with open(path, "wb") as f:
        f.write(data)
    return path, dict(settings)


def _export(partition, example_inputs) -> tuple:
    optimize = (not getattr(_DECODER, "on", False)
                and sum(n.op == "call_function" for n in partition.graph.nodes) <= EXPORTER_OPTIMIZE_MAX_OPS)
    with torch.no_grad(), quiet():
        program = ort_export.export(partition, example_inputs, opset=EXPORT_OPSET, optimize=optimize,
                                    registry=registry())
    # the model stays in memory from export to quantization: each save and load of a
    # 135M-parameter decoder costs seconds
    proto = program.model_proto
    settings = {"opset": EXPORT_OPSET, "exporter_optimized": optimize}
    rewritten = ort_rewrites.rewrite(proto)
    if rewritten:
        settings["rewritten"] = rewritten
    return proto, settings


def quantized(partition, example_inputs, options, calibration, tmp: str, merge: bool = True) -> tuple:
    """``(path, settings)``: the partition's model quantized as ``options`` ask, written in
    ``tmp``; ``merge``: products sharing an input joined (:mod:`kiln.engines.ort_merge`,
    ONNX Runtime's engine) or not (OpenVINO's). A weight-only model is kept for the
    partition's next engine that asks for the same (above)."""
    key = (options.quantize, options.quantize_mode, merge)
    shared = options.quantize_mode == "weight_only"
    with _LOCK:
        kept = _KEPT.get(partition, {}).get(key) if shared else None
    path = os.path.join(tmp, "quantized.onnx")
    if kept is not None:
        with open(path, "wb") as f:
            f.write(kept[0])
        return path, dict(kept[1])
    proto, settings = exported(partition, example_inputs)
    path, products = ort_quantize.quantize(proto, tmp, options, calibration or [list(example_inputs)], merge=merge,
                                           llm_head=getattr(_DECODER, "on", False))
    settings = dict(settings, products=products)
    if shared and not os.path.exists(path + ".data"):     # under protobuf's 2 GB: one file
        with open(path, "rb") as f:
            data = f.read()
        with _LOCK:
            _KEPT.setdefault(partition, {})[key] = (data, dict(settings))
    return path, settings
