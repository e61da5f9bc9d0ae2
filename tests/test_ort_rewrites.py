"""kiln.engines.ort_rewrites: exact node-removing rewrites in the ONNX Runtime engine.

Each rewrite must match the pattern torch's exporter writes (a Llama-style RMSNorm and
3-D linear layers), leave the arithmetic alone (outputs equal eager PyTorch), and refuse
when a value it would remove is used elsewhere."""
import collections

import pytest
import torch
from torch import nn

from kiln import engines
from kiln.compiler.options import CompileOptions
from kiln.engines import onnx_model, onnxruntime as ort_engine
from kiln.graph.capture import capture
from kiln.runtime.options import RuntimeOptions
from tests.conftest import assert_close

TOL = {"atol": 1e-5, "rtol": 1e-5}


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm, spelled as it is there; ``leak``: also return the
    mean square, which the fusion must then leave in place."""

    def __init__(self, dim, leak=False):
        super().__init__()
        self.weight, self.leak = nn.Parameter(1 + 0.2 * torch.randn(dim)), leak

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        out = self.weight * (x * torch.rsqrt(variance + 1e-5))
        return (out, variance) if self.leak else out


class Block(nn.Module):
    """RMSNorm, two products sharing one input (query and key), one product of its own
    (output); ``leak`` also returns the norm's mean square and the flattened activation
    that query and key read."""

    def __init__(self, leak=False, dim=32):
        super().__init__()
        torch.manual_seed(0)
        self.norm = RMSNorm(dim, leak)
        self.q, self.k = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim // 2, bias=False)
        self.o = nn.Linear(dim + dim // 2, dim, bias=False)
        self.leak, self.dim = leak, dim

    def forward(self, x):
        h, variance = self.norm(x) if self.leak else (self.norm(x), None)
        flat = h.reshape(-1, self.dim)
        q = (flat @ self.q.weight.T).reshape(2, 5, self.dim)
        k = (flat @ self.k.weight.T).reshape(2, 5, self.dim // 2)
        out = self.o(torch.cat([q, k], dim=-1)) + x
        return (out, variance, flat) if self.leak else out


@pytest.fixture(autouse=True)
def unoptimized_export(monkeypatch):
    """As for a large partition: without the exporter's own optimizer, which would fuse
    these itself (and costs tens of seconds on a 30-layer decoder)."""
    monkeypatch.setattr(onnx_model, "EXPORTER_OPTIMIZE_MAX_OPS", 0)


def _compile(module, tol=TOL, **options):
    torch.manual_seed(0)
    x = torch.randn(2, 5, module.dim)
    captured = capture(module.eval(), (x,))
    with torch.no_grad():
        expected = module(x)
    engine = engines.get("onnxruntime")
    opts = CompileOptions(engine="onnxruntime", device="cpu", **options)
    blob = engine.compile(captured.graph_module, captured.example_inputs, opts)
    got = engine.load(blob, RuntimeOptions(threads=1))(list(captured.example_inputs))
    for a, e in zip(got, expected if isinstance(expected, tuple) else (expected,)):
        if isinstance(tol, float):  # int8: close in direction (cosine), as tests/test_quantize.py checks
            assert torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0) > tol
        else:
            assert_close(a, e, **tol)
    ops = collections.Counter(n.op_type for n in ort_engine.graph_of(blob).graph.node)
    return ort_engine.header_of(blob).get("rewritten", {}), ops


def test_rms_norm_and_3d_linears_rewritten_and_equal_eager():
    rewritten, ops = _compile(Block())
    assert rewritten == {"transpose": 3, "linear": 3, "rms_norm": 1}
    assert ops["Reshape"] == 0 and ops["Pow"] == 0 and ops["Reciprocal"] == 0, ops
    assert ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"] == 1, ops


def test_rewrites_keep_values_used_elsewhere():
    rewritten, ops = _compile(Block(leak=True))
    # the flattened activation is an output: query and key keep their reshapes, the
    # output projection (its own input) is still rewritten; the mean square is an
    # output, so the norm stays unfused
    assert rewritten.get("linear") == 1 and "rms_norm" not in rewritten, rewritten
    assert ops["Reshape"] >= 1 and ops["SimplifiedLayerNormalization"] == 0, ops


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
def test_rewritten_graph_goes_through_quantization(mode):
    """weight_only quantizes the rewritten model in memory; dynamic goes through ORT's
    pre-processing, which copies the model file alone: the weights must be inline (a data
    file beside it was lost once, at a size where ORT's optimizer keeps them external)."""
    # dynamic int8 quantizes each activation tensor with one scale: ~0.97 on this block
    # with or without the rewrites
    rewritten, ops = _compile(Block(dim=512), tol=0.99 if mode == "weight_only" else 0.95, quantize="int8",
                              quantize_mode=mode)
    assert rewritten == {"transpose": 3, "linear": 3, "rms_norm": 1}
    assert ops["MatMulNBits" if mode == "weight_only" else "DynamicQuantizeLinear"] >= 1, ops


def test_a_transposed_weight_is_rewritten_in_place_and_a_shared_one_kept():
    """A weight that feeds only its Transpose becomes the transposed weight under the
    Transpose's output name (no copy appended); one that something else also reads stays,
    beside a transposed copy. ONNX Runtime runs the result to the same values."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from kiln.engines import ort_rewrites
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = np.arange(6, dtype=np.float32).reshape(3, 2) - 2
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"]),
         helper.make_node("Transpose", ["v"], ["vt"], perm=[1, 0]), helper.make_node("Relu", ["vt"], ["r"]),
         helper.make_node("Identity", ["v"], ["vv"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
         for name, shape in (("y", [1, 2]), ("r", [2, 3]), ("vv", [3, 2]))],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    assert ort_rewrites._weight_transposes(model.graph) == 2
    # w rewritten where it lay (first), v kept for the Identity, its transpose appended
    assert [i.name for i in model.graph.initializer] == ["wt", "v", "vt"]
    assert not any(n.op_type == "Transpose" for n in model.graph.node)
    x = np.array([[1.0, -2.0, 0.5]], np.float32)
    y, r, vv = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, x @ w.T)
    np.testing.assert_array_equal(r, np.maximum(v.T, 0))
    np.testing.assert_array_equal(vv, v)
