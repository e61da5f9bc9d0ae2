"""kiln.engines.ort_int4: int4 blocks with a float minimum (GGUF's Q4_1) on MatMulNBits.

Weights that are Q4_1 blocks (as a GGUF file's, dequantized by transformers) must come
back exactly; the compiled product must equal eager up to the kernel's int8 activations."""
import collections
import logging

import numpy as np
import torch
from torch import nn

import kiln
from kiln.engines import ort_int4
from kiln.engines.onnxruntime import graph_of


def q4_1_weight(k, n, seed=0):
    """A ``[K, N]`` weight made of Q4_1 blocks: ``d * q + m``, ``d`` and ``m`` in float16."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15                      # quantize_row_q4_1 maps min to 0, max to 15
    d = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16).astype(np.float32)
    m = (-rng.random((n, k // 32)) * 0.08).astype(np.float16).astype(np.float32)
    return (q * d[..., None] + m[..., None]).astype(np.float32).reshape(n, k).T.copy()


def test_q4_1_blocks_come_back_exactly():
    w = q4_1_weight(96, 40)
    back = ort_int4.dequantized(*ort_int4.blocks(w))
    assert np.abs(back - w).max() <= 1e-6 * np.abs(w).max()


def test_other_weights_are_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((64, 24)).astype(np.float32)
    packed, scales, offsets = ort_int4.blocks(w)
    err = np.abs(ort_int4.dequantized(packed, scales, offsets) - w).reshape(2, 32, 24)
    assert (err.max(axis=1) <= scales.T * 0.5 + 1e-6).all()


class TwoProducts(nn.Module):
    """An int4 product of Q4_1 weights, then a wider one (the "output projection", which
    stays int8)."""

    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(96, 64, bias=False), nn.Linear(64, 128, bias=False)
        with torch.no_grad():
            self.inner.weight.copy_(torch.from_numpy(q4_1_weight(96, 64).T.copy()))

    def forward(self, x):
        h = self.inner(x)
        return h, self.head(h)


def test_compiled_product_equals_eager_up_to_int8_activations():
    model = TwoProducts().eval()
    x = torch.randn(3, 5, 96)
    with torch.no_grad():
        want, _ = model(x)
    m = kiln.trace(model, x, quantize="int4", quantize_mode="weight_only", cache=False)
    got, _ = m(x)
    # the weights are exact; what is left is MatMulNBits quantizing x to int8 per block
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    blob = m._artifact.blobs[m.manifest["partitions"][0]["blob"]]
    ops = collections.Counter(n.op_type for n in graph_of(blob).graph.node)
    assert ops["MatMulNBits"] == 2 and ops["ReduceSum"] == 1, ops


def test_importing_ort_quantizer_leaves_the_root_logger_alone():
    """ORT's matmul_nbits_quantizer runs logging.basicConfig(INFO) on import; through
    kiln it must not leave a handler on the user's root logger (it printed ~6,000 INFO
    lines during one int8 LLM compile)."""
    from tests.conftest import run_py
    code = """
import logging
from kiln.quiet import import_quietly
import_quietly("onnxruntime.quantization.matmul_nbits_quantizer")
root = logging.getLogger()
print(len(root.handlers), root.level)
logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").info("must not print")
"""
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", str(logging.WARNING)]
    assert "must not print" not in r.stderr


def test_a_model_protobuf_cannot_size_is_saved_with_external_data(monkeypatch, tmp_path):
    """Over 2 GB, protobuf refuses to serialize a model (EncodeError, or ValueError from
    upb): a 2.4 GB float32 model failed to compile on ONNX Runtime that way. Such a model is
    written with its weights in an external file (checked by hand end to end: 47 s,
    answers equal to eager); a model under the limit is written as it serializes."""
    import onnx
    from google.protobuf.message import EncodeError

    from kiln.engines import ort_quantize

    for refusal in (EncodeError("Failed to serialize proto"), ValueError("Message exceeds 2GB")):
        class Huge:
            def SerializeToString(self):
                raise refusal
        seen = {}
        monkeypatch.setattr(onnx, "save_model", lambda model, path, **kw: seen.update(kw))
        assert ort_quantize.save(Huge(), str(tmp_path / "m.onnx")) == str(tmp_path / "m.onnx")
        assert seen["save_as_external_data"] is True and seen["location"] == "m.onnx.data"
    small = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    seen.clear()
    ort_quantize.save(small, str(tmp_path / "s.onnx"))
    assert not seen and onnx.load(str(tmp_path / "s.onnx")) == small
