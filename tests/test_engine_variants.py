"""-O3's engine variants: each builds a tiny BERT and matches eager; the ONNX Runtime
``transformers`` variant really contains ORT's fused transformer ops."""
import collections

import pytest
import torch

from kiln import engines
from kiln.compiler.options import CompileOptions
from kiln.engines import onnxruntime as ort_engine
from kiln.graph.capture import capture
from kiln.runtime.options import RuntimeOptions
from tests.conftest import assert_close

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    for p in model.parameters():       # random biases too (BERT initialises them to zero)
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 100, (1, 16))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0
    inputs = (ids, mask, torch.zeros_like(ids))
    captured = capture(model, inputs)
    with torch.no_grad():
        expected = [t for t in captured.graph_module(*captured.example_inputs) if isinstance(t, torch.Tensor)]
    return captured, expected


def _build(name, variant, captured):
    engine = engines.get(name)
    opts = CompileOptions(engine=name, device="cpu", optlevel=3)
    assert variant in engine.variants(opts)
    blob = engine.compile(captured.graph_module, captured.example_inputs, opts, variant=variant)
    return blob, engine.load(blob, RuntimeOptions(threads=1))


def _check(runner, captured, expected):
    got = runner(list(captured.example_inputs))
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        assert_close(a, e, **TOL)


def test_ort_transformers_variant_fuses_and_matches_eager(bert):
    captured, expected = bert
    blob, runner = _build("onnxruntime", "transformers", captured)
    _check(runner, captured, expected)
    header = ort_engine.header_of(blob)
    assert header["variant"] == "transformers"
    assert header["fused"].get("BiasGelu", 0) >= 1 and header["fused"].get("Attention", 0) >= 1
    ops = collections.Counter(n.op_type for n in ort_engine.graph_of(blob).graph.node)
    assert ops["SkipLayerNormalization"] >= 3 and ops["BiasGelu"] >= 1, ops


def test_ort_transformers_variant_off_for_portable_and_int8():
    engine = engines.get("onnxruntime")
    assert engine.variants(CompileOptions(target="generic")) == ()
    assert engine.variants(CompileOptions(quantize="int8")) == ()



@pytest.fixture(scope="module")
def masked_bert():
    """Tiny BERT, batch 3: a full row, a padded row, and a row whose every key is masked
    (torch's SDPA gives zeros there, not NaN or a uniform average)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2] = 0
    captured = capture(model, (ids, mask, torch.zeros_like(ids)))
    with torch.no_grad():
        expected = [t for t in captured.graph_module(*captured.example_inputs) if isinstance(t, torch.Tensor)]
    return captured, expected, cfg


def test_capture_keeps_attention_whole(masked_bert):
    captured, _, cfg = masked_bert
    targets = collections.Counter(n.target for n in captured.graph_module.graph.nodes)
    assert targets[torch.ops.aten.scaled_dot_product_attention.default] == cfg.num_hidden_layers
    assert targets[torch.ops.aten._softmax.default] == 0


@pytest.mark.parametrize("name", engines.names())
def test_every_engine_runs_whole_attention_with_masked_rows_like_eager(masked_bert, name):
    captured, expected, _ = masked_bert
    engine = engines.get(name)
    if "cpu" not in engine.devices:
        pytest.skip(f"{name} has no CPU build")
    blob = engine.compile(captured.graph_module, captured.example_inputs, CompileOptions(engine=name))
    got = engine.load(blob, RuntimeOptions(threads=1))(list(captured.example_inputs))
    assert not torch.isnan(got[0]).any()
    for a, e in zip(got, expected):
        assert_close(a, e, **TOL)


def test_ort_runs_sdpa_as_one_attention_op(masked_bert):
    """The exporter's opset-23 SDPA is ONNX's fused Attention op in the blob, not a softmax."""
    captured, _, cfg = masked_bert
    engine = engines.get("onnxruntime")
    blob = engine.compile(captured.graph_module, captured.example_inputs, CompileOptions(engine="onnxruntime"))
    ops = collections.Counter(n.op_type for n in ort_engine.graph_of(blob).graph.node)
    assert ops["Attention"] == cfg.num_hidden_layers and ops["Softmax"] == 0, ops
    assert ort_engine.header_of(blob)["opset"] == ort_engine.EXPORT_OPSET
