"""ONNX Runtime's own quantization tools, applied to an exported partition.

``quantize`` takes the ONNX model a partition was exported to and returns the quantized
model the session is then built from: int8 dynamic or static (QDQ) through
``onnxruntime.quantization``, or weight-only int8/int4 as ``MatMulNBits``.
"""
from __future__ import annotations

import contextlib
import os

from kiln.engines import onnx_products
from kiln.quiet import EXPORTER_LOGGERS, import_quietly, quiet


def quantize(model, tmp: str, options, calibration, merge: bool = True, llm_head: bool = False) -> tuple:
    """int8 / int4 through ONNX Runtime's own quantization tools; ``model`` an
    ``onnx.ModelProto``; ``(path, products)`` returned: the quantized model's path and what
    :func:`kiln.engines.onnx_products.count` says of it. ``merge``: weight-only
    products sharing an input joined into one (:mod:`kiln.engines.ort_merge`). ``llm_head``: the
    graph is an LLM's step, whose widest product (the output projection) stays int8 in weight-only
    builds (:func:`_weight_only`); another model's widest layer is quantized as asked (until 12-03 an
    int4 MLP's widest layer, most of its weights, was stored in 8 bits and counted as int4).

    dynamic: weights to int8 ahead of time, activations quantized per call (no data).
    static: weights and activations int8 (QDQ) with ranges calibrated on ``calibration``,
    a list of partition input lists.
    weight_only: MatMul weights packed for ``MatMulNBits`` (int8 in symmetric groups of 32,
    GGUF's Q8_0, or int4 in groups of 32 with a float minimum, along the input dim, as GGUF's Q4_1
    blocks: :mod:`kiln.engines.ort_int4`), no calibration;
    activations stay float between ops (the kernel quantizes each block of its input to
    int8 on the fly, ``ACCURACY_LEVEL``), so a decode step, which reads every weight
    once, reads ~4x (int8) or ~6x (int4) fewer bytes than in float32. It needs no
    pre-processing (the weights are constants once :mod:`kiln.engines.ort_rewrites` has
    folded their transposes), so the model is quantized in memory and written once.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process
    out = os.path.join(tmp, "quantized.onnx")
    with quiet(EXPORTER_LOGGERS + ("root",)):
        if options.quantize_mode == "weight_only":
            # MatMulNBits has no convolution: ORT's weight-only quantizer logged an error per
            # Conv and left it in float; they stay float without the noise (the count says so)
            nodes = _gemm_to_matmul(model, _weight_nodes(model, convolutions=False))
            quantized = _weight_only(model, nodes, 4 if options.quantize == "int4" else 8, merge, llm_head)
            save(quantized, out)
            return out, onnx_products.count(quantized)
        prepared = os.path.join(tmp, "prepared.onnx")
        # ORT's pre-processing copies the model file alone: weights inline (save())
        quant_pre_process(save(model, os.path.join(tmp, "model.onnx")), prepared, skip_symbolic_shape=True)
        import onnx
        model = onnx.load(prepared)
        nodes = _gemm_to_matmul(model, _weight_nodes(model))
        save(model, prepared)
        if options.quantize_mode == "dynamic":
            quantize_dynamic(prepared, out, weight_type=QuantType.QInt8, per_channel=True,
                             nodes_to_quantize=nodes)
        else:
            quantize_static(prepared, out, _Calibration(prepared, calibration),
                            quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            nodes_to_quantize=nodes)
    return out, onnx_products.count(onnx.load(out, load_external_data=False))


def save(model, path: str) -> str:
    """Write ``model`` to ``path`` with its weights inline, as torch's exporter does below
    protobuf's 2 GB limit (beyond it, in ``path + ".data"``); ``path`` returned."""
    import onnx
    data = serialized(model)
    if data is not None:
        with open(path, "wb") as f:
            f.write(data)
        return path
    onnx.save_model(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data")
    return path


def serialized(model) -> bytes | None:
    """``model``'s bytes, or None where protobuf cannot hold it in one message (2 GB)."""
    from google.protobuf.message import EncodeError
    try:
        # serialized once: sizing the message first (ByteSize) costs as much again, 1.3 s
        # for SmolLM2's 660 MB graph
        data = model.SerializeToString()
    except (EncodeError, ValueError):   # protobuf refuses a message over 2 GB
        return None
    return data if len(data) < 2**31 - 2**24 else None


INT4_GROUP = 32
# MatMulNBits has no per-channel form (its quantizer refuses channel_wised_quantize for
# the operator format); int8 uses groups of 32 along the input dim (GGUF's Q8_0), finer than
# per channel. Not 128: on an AVX-512 VNNI machine ORT's int8 kernel for 128-wide blocks
# computed one row differently from the same row among eight (1e-6; batched SmolLM2 chats
# parted from their solo runs, kiln.runtime.invariance), and its 32-wide kernel did not;
# SmolLM2's 1-row decode step took 15.4 ms against 15.2 with 128 (same machine, under load).
INT8_GROUP = 32
# An LLM's output projection (int4 and int8 builds): int8 in GGUF's Q8_0 blocks, on its grid
# (_q8_0_head). In an int8 build the widest product is taken so only when it reads an
# activation of its own: one that shares it (a query/key/value) joins the others instead.
HEAD_GROUP = 32
# accuracy_level 4: the kernel quantizes each activation block to int8 and multiplies in
# integers. Measured on SmolLM2-135M's decode step (2 cores, AVX2): int4 16.2 ms against
# 38.8 ms with float compute (level 0), int8 27.4 ms against 343 ms; the LLM gate
# (kiln.llm.gate) judges what it costs in accuracy.
ACCURACY_LEVEL = 4


def _weight_only(model, nodes: list, bits: int, merge: bool = True, llm_head: bool = True):
    """MatMul nodes in ``nodes`` of ``model`` to MatMulNBits (see :func:`quantize`); the new model.

    int4 is :mod:`kiln.engines.ort_int4`'s blocks with a float minimum (GGUF's Q4_1,
    exact for weights that came from it); a product it cannot take (input dim not a
    multiple of 32) gets ORT's symmetric int4. The widest product (an LLM's output
    projection, whose errors every token's choice sees) stays int8 in groups of 32, as
    GGUF's Q4 files keep it, on Q8_0's own grid (:func:`_q8_0_head`: exact for weights
    that came from one); a tied embedding then reads those blocks (:mod:`~kiln.engines.ort_tied`)."""
    from kiln.engines import ort_blocks, ort_int4, ort_merge, ort_tied
    quantizer = import_quietly("onnxruntime.quantization.matmul_nbits_quantizer")
    # weights a file's own blocks are kept for (kiln.engines.ort_blocks) first; the rest as asked
    nodes = ort_blocks.apply(model, nodes, ACCURACY_LEVEL)
    head = _widest(model, nodes) if llm_head else None
    if bits == 8 and head and _shares_input(model, head, nodes):
        head = None         # int8 alike either way: left to join the products it shares an input with
    # products sharing an activation (query/key/value, gate/up) become one (kiln.engines.ort_merge)
    rest = [n for n in nodes if n != head]
    if merge:
        rest = ort_merge.merge(model, rest)
    if bits == 4:
        rest = ort_int4.apply(model, rest, ACCURACY_LEVEL)
    if head and _q8_0_head(model, head):
        head = None
    for group, width, chosen in ((bits, INT4_GROUP if bits == 4 else INT8_GROUP, rest),
                                 (8, HEAD_GROUP, [head] if head else [])):
        if not chosen:
            continue
        # nodes_to_include does not exclude: the quantizer also takes every other MatMul
        # with a constant weight (ort_int4's offset products among them) unless told not to
        others = [n.name for n in model.graph.node if n.name not in chosen]
        q = quantizer.MatMulNBitsQuantizer(model, bits=group, block_size=width, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, nodes_to_include=chosen,
                                 nodes_to_exclude=others)
        _share_blocks(q.node_quantizer)
        with _value_infos_aside(model):
            q.process()
        model = q.model.model
    # a tied token embedding read from the output projection's blocks (kiln.engines.ort_tied)
    ort_tied.share_embedding(model)
    return model


def _share_blocks(node_quantizer) -> None:
    """ONNX Runtime's block quantizer (``qbits_block_quant``: a weight in, its packed blocks,
    scales and zero points out) for this one quantizer, through :func:`kiln.engines.ort_once.once`:
    a weight the compile's other graphs hold is quantized once (the same arrays back)."""
    from kiln.engines import ort_once
    compute, c = node_quantizer.qbits_block_quant, node_quantizer.config
    settings = (c.bits, c.block_size, c.is_symmetric, str(c.quant_format), bool(getattr(c, "channel_wised_quantize", 0)))
    node_quantizer.qbits_block_quant = lambda w: ort_once.once("onnxruntime", w, settings, lambda: compute(w))


@contextlib.contextmanager
def _value_infos_aside(model):
    """``model``'s value infos set aside for the block, then put back.

    ONNX Runtime's ``MatMulNBitsQuantizer`` (1.32) looks up each product's input rank by a
    linear scan of the graph's inputs, value infos and outputs (``_get_static_rank``), for
    every product, and uses the rank only for weights of more than two dimensions, which
    :func:`_weight_nodes` never passes it. On SmolLM2's graphs the scans took 2.7 s of an
    int8 build's 14.4 s of quantizing (360 calls, 7.5 ms each); without the value infos the
    quantized models are the same bytes (checked on SmolLM2's int8 and int4 builds)."""
    infos = list(model.graph.value_info)
    del model.graph.value_info[:]
    try:
        yield
    finally:
        model.graph.value_info.extend(infos)


def _q8_0_head(model, head: str) -> bool:
    """The output projection ``head`` as int8 blocks on GGUF's Q8_0 grid, through the kept
    blocks' rewrite (:func:`kiln.engines.ort_blocks.q8_0`): exact for a head that came from
    a Q8_0 file, as SmolLM2's Q4 files store it. False (nothing done) without whole blocks."""
    from onnx import numpy_helper
    from kiln.engines import ort_blocks, ort_once
    node = next(n for n in model.graph.node if n.name == head)
    weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == node.input[1]))
    if weight.shape[0] % HEAD_GROUP:
        return False        # no whole blocks along K: ONNX Runtime's quantizer takes it
    key = ort_blocks.fingerprint(weight)            # its values, hashed once for both tables
    kept = ort_once.once("q8_0", weight, (HEAD_GROUP,), lambda: ort_blocks.q8_0(weight, HEAD_GROUP),
                         digest=(weight.dtype.name, key))
    with ort_blocks.keeping({key: kept}):
        ort_blocks.apply(model, [head], ACCURACY_LEVEL)
    return True


def _shares_input(model, name: str, nodes: list) -> bool:
    """Whether MatMul ``name`` reads an activation another MatMul in ``nodes`` reads too."""
    by_name = {n.name: n for n in model.graph.node}
    x = by_name[name].input[0]
    return any(by_name[m].input[0] == x for m in nodes if m != name and m in by_name)


def _widest(model, nodes: list):
    """The MatMul in ``nodes`` whose constant weight has the most output columns."""
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    best = (0, None)
    for n in model.graph.node:
        if n.name in nodes and len(dims.get(n.input[1], [])) == 2:
            best = max(best, (dims[n.input[1]][1], n.name))
    return best[1]


def _weight_nodes(model, convolutions: bool = True) -> list:
    """MatMul/Gemm/Conv nodes whose weight is a constant: the ones int8 pays off for
    (``convolutions=False``: MatMul/Gemm only).

    Products of two activations (attention scores) stay in fp32: quantizing them
    costs accuracy for little speed.
    """
    graph = model.graph
    rank = {i.name: len(i.dims) for i in graph.initializer}

    def weight(n):
        r = rank.get(n.input[1]) if len(n.input) > 1 else None
        # per-channel int8 needs a plain [K, N] matrix (or a conv kernel)
        return r is not None and (r == 2 or n.op_type == "Conv")

    kinds = ("MatMul", "Gemm", "Conv") if convolutions else ("MatMul", "Gemm")
    return [n.name for n in graph.node if n.op_type in kinds and weight(n)]


def _gemm_to_matmul(model, nodes: list) -> list:
    """Rewrite plain weight Gemms as MatMul + Add, in place; return the new node names.

    ORT's dynamic quantizer handles MatMul but not Gemm, and torch's exporter
    emits Gemm for every linear layer.
    """
    from onnx import helper, numpy_helper
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
