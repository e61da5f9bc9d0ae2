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
    assert header["fused"].get("SkipLayerNormalization", 0) >= 3
    ops = collections.Counter(n.op_type for n in ort_engine.graph_of(blob).graph.node)
    assert ops["SkipLayerNormalization"] >= 3 and ops["BiasGelu"] >= 1, ops


def test_ort_transformers_variant_off_for_portable_and_int8():
    engine = engines.get("onnxruntime")
    assert engine.variants(CompileOptions(target="generic")) == ()
    assert engine.variants(CompileOptions(quantize="int8")) == ()
