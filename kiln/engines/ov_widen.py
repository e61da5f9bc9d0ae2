"""4-bit weights handed to OpenVINO one value per byte: the same answers, a quarter the import.

Why: OpenVINO's CPU plugin repacks a compressed product's weights for its kernels when it
compiles *or imports* a model, and for 4-bit weights it does so in a scalar loop (one
element pair at a time, its index computed through the layout's descriptors: 60 % of an
import's time in ``perf``). SmolLM2 int4's 128-token prefill took 1.0-1.4 s to import,
the longest part of loading the whole LLM, where the int8 build's, larger, took 0.7 s.

How: every 4-bit ``MatMulNBits`` becomes an 8-bit one holding the same values (0-15, one a
byte), the same scales and the same zero points: float ones as they are, packed 4-bit ones
one a byte, and none (4-bit's implied 8) written out as 8. OpenVINO computes both forms with
the same kernels: on 576- and 96-wide products the outputs are bit for bit equal, in bf16
and in f32, with float, integer and implied zero points (``tests/test_ov_widen.py``). The one
case found where they are not, integer zero points packed with a padded byte a row (an odd
number of blocks), is left 4-bit: there OpenVINO computed the 4-bit product in float.
A chain of SmolLM2's 120 layer products imported in 0.34-0.44 s instead of 1.15-1.45 s and
ran as fast; its blob is 133 MB instead of 80 MB, as the weights in memory are larger by as
much. ONNX Runtime's graphs are not touched: its 4-bit kernel is what decode runs on.
"""
from __future__ import annotations

import numpy as np

from kiln.engines.ort_graph import attr

_MS = "com.microsoft"


def widen(model) -> int:
    """Every 4-bit ``MatMulNBits`` of ``model`` (an ``onnx.ModelProto``, weights in memory)
    as an 8-bit one with the same values (module doc), in place; how many."""
    from onnx import helper, numpy_helper
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    count, widened = 0, set()
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != _MS or attr(node, "bits", 4) != 4:
            continue
        packed = inits.get(node.input[1])
        zero = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        if packed is None or (len(node.input) > 3 and node.input[3] and zero is None) or len(node.input) > 4:
            continue          # weights computed in the graph, or a group index: left as they are
        n, k, block = attr(node, "N"), attr(node, "K"), attr(node, "block_size")
        blocks = -(-k // block)
        if zero is not None and zero.data_type == 2 and blocks % 2:
            # packed integer zero points with a padded last byte a row: there OpenVINO computed
            # the 4-bit product in float and the 8-bit one with int8 activations (5e-3 apart)
            continue
        if zero is None:
            points = np.full(n * blocks, 8, np.uint8)
        else:
            points = numpy_helper.to_array(zero)
            if points.dtype == np.uint8:        # two a byte, each row's padded to whole bytes
                points = _nibbles(points.reshape(n, -1))[:, :blocks].reshape(-1)
        if packed.name not in widened:          # a weight two products read: widened once
            values = _nibbles(numpy_helper.to_array(packed)).reshape(n, blocks, -1)[:, :, :block]
            packed.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values), packed.name))
            widened.add(packed.name)
        name = node.name + "/kiln_zero_points8"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(points), name))
        inputs = list(node.input[:3]) + [name]
        del node.input[:]
        node.input.extend(inputs)
        for a in node.attribute:
            if a.name == "bits":
                a.CopyFrom(helper.make_attribute("bits", 8))
        count += 1
    used = {i for n in graph.node for i in n.input}
    for index in reversed([k for k, i in enumerate(graph.initializer) if i.name not in used]):
        del graph.initializer[index]        # replaced zero points; by index, no weight compared
    return count


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[..., m]`` bytes -> ``[..., 2m]`` 4-bit values, the low nibble first (ONNX Runtime's order)."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out
