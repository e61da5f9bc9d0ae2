"""OpenVINO's compiled-model export, and what kiln does about what it gets wrong
(:mod:`kiln.engines.ov_export`): ONNX's ``RotaryEmbedding`` is written as plain arithmetic
before OpenVINO reads a model, and a lossy build whose import answers differently from
the model it was exported from is refused."""
import numpy as np
import pytest
import torch

ov = pytest.importorskip("openvino")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto as TP, helper  # noqa: E402

from kiln.engines import ov_export  # noqa: E402
from kiln.engines.openvino import OvRunner  # noqa: E402

CFG = {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "1"}


def _rotary_model(B=1, H=3, T=12, D=16, **attrs):
    attrs = {"interleaved": 0, **attrs}
    nodes = [helper.make_node("Cos", ["ang"], ["c"]), helper.make_node("Sin", ["ang"], ["s"]),
             helper.make_node("RotaryEmbedding", ["x", "c", "s"], ["y"], name="rope", **attrs)]
    x_shape = [B, H, T, D] if "num_heads" not in attrs else [B, T, H * D]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, x_shape),
                                       helper.make_tensor_value_info("ang", TP.FLOAT, [B, T, D // 2])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, x_shape)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    freq = 1.0 / 10000 ** (np.arange(D // 2) / (D // 2))
    ang = np.broadcast_to(np.arange(T)[None, :, None] * freq[None, None], (B, T, D // 2)).astype(np.float32)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), x, ang


def _ort(model, x, ang):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "ang": ang})[0]


def _ov(model, x, ang):
    """(compiled, imported) answers of OpenVINO's CPU plugin, the way kiln stores a model."""
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU", CFG)
    imported = core.import_model(ov.Tensor(np.frombuffer(ov_export.export(compiled), dtype=np.uint8)), "CPU", CFG)
    return compiled([x, ang])[0], imported([x, ang])[0]


def test_rotary_embedding_is_written_as_its_own_definition():
    model, x, ang = _rotary_model()
    expected = _ort(model, x, ang)
    assert ov_export.decompose_rotary(model) == 1
    assert not [n for n in model.graph.node if n.op_type == "RotaryEmbedding"]
    onnx.checker.check_model(model)
    np.testing.assert_allclose(_ort(model, x, ang), expected, rtol=1e-6, atol=1e-6)


def test_forms_it_does_not_cover_are_left_alone():
    for model, *_ in (_rotary_model(num_heads=3), _rotary_model(interleaved=1)):
        assert ov_export.decompose_rotary(model) == 0
        assert [n.op_type for n in model.graph.node].count("RotaryEmbedding") == 1


def test_openvinos_import_answers_as_its_compile_once_rotary_is_decomposed():
    """OpenVINO 2026.4's import of the op itself computed garbage (0.5 to 1e35 off) where the
    compiled model was exact; written out, both equal ONNX Runtime's answer."""
    model, x, ang = _rotary_model(T=16)
    expected = _ort(model, x, ang)
    ov_export.decompose_rotary(model)
    compiled, imported = _ov(model, x, ang)
    np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(imported, expected, rtol=1e-5, atol=1e-5)


def _scaled(k):
    g = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TP.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2, 8])],
                          [helper.make_tensor("k", TP.FLOAT, [1], [k])])
    core = ov.Core()
    return core, core.compile_model(core.read_model(helper.make_model(g).SerializeToString(), b""), "CPU", CFG)


def test_an_export_that_answers_differently_after_import_is_refused():
    core, compiled = _scaled(2.0)
    x = [torch.randn(2, 8)]
    ov_export.check_round_trip(core, compiled, ov_export.export(compiled), CFG, x, OvRunner)
    _, other = _scaled(2.001)
    with pytest.raises(RuntimeError, match="answers differently after import"):
        ov_export.check_round_trip(core, compiled, ov_export.export(other), CFG, x, OvRunner)


def test_a_small_llamas_int4_prefill_on_openvino_answers_as_onnx_runtimes_after_load():
    """The exporter writes RotaryEmbedding for a 2-layer Llama's prefill; on OpenVINO its
    keys came back wrong at the last position on every build (0.5 to 1e35 off; cosine
    0.05-0.95 against eager). Compiled on each engine and loaded from the artifact, the two
    int4 prefills now agree: the same blocks, activations quantized the same way."""
    transformers = pytest.importorskip("transformers")
    import kiln
    from kiln.llm.decoder import DecoderStep
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    step = DecoderStep(transformers.LlamaForCausalLM(cfg).eval(), with_cache=False, last_only=True).eval()
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    example = (ids, torch.arange(16)[None], torch.tensor([15]))
    out = {}
    for engine in ("openvino", "onnxruntime"):
        built = kiln.trace(step, example, engine=engine, quantize="int4", quantize_mode="weight_only",
                           min_cosine=0.9, min_top1=0.0, cache=False, quiet=True)
        loaded = kiln.load(built.to_bytes())
        assert {p["engine"] for p in loaded.manifest["partitions"]} == {engine}
        out[engine] = loaded(*example)
    for a, b in zip(out["openvino"], out["onnxruntime"]):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999
        assert (a - b).abs().max() < 0.02 * b.abs().max()
