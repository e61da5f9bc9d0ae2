"""Weight-only int8 / int4 LLMs (ONNX Runtime's MatMulNBits) and the accuracy gate:
perplexity and greedy agreement against float32, with the numbers when it fails."""
import pytest

pytest.importorskip("transformers")

from kiln.errors import ValidationError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from tests.test_llm_decoder import _model  # noqa: E402

OPTIONS = dict(batch_size=1, context_buckets=(8,), cache_length=80, optlevel=1)


# The tiny random model's next-token distributions are nearly flat (perplexity ~109 over
# 97 ids), so any perturbation flips near-ties: int4 keeps ~56 % greedy agreement here
# against the default 75 % (calibrated on real weights: SmolLM2 in the slow test below).
LIMITS = {"int8": {}, "int4": {"min_agreement": 0.4}}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_llm_passes_the_gate_and_stores_its_numbers(mode):
    llm = compile_llm(_model("llama"), quantize=mode, **OPTIONS, **LIMITS[mode])
    gate = llm.meta["accuracy_gate"]
    assert gate["passed"] and gate["tokens"] == 63
    assert gate["ppl_ratio"] <= gate["max_ppl_ratio"] and gate["agreement"] >= gate["min_agreement"]
    assert gate["ppl_ratio"] != 1.0                    # the weights really are quantized
    engines = {e for m in [*llm.prefill.values(), *llm.decode.values()] for e, _ in m.manifest["engines"]}
    assert engines == {"onnxruntime"}
    assert len(llm.generate([[5, 17, 3]], 10, stop_at_eos=False)[0]) == 10


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_gates_one_pass_reference_equals_a_step_at_a_time(family):
    """The float32 reference reads the gate's text in one forward pass; each position's
    logits are those prefill and one decode step per token give (what the gate read
    before), to float rounding."""
    import torch

    from kiln.llm import gate
    from kiln.llm.decoder import DecoderStep, cache_shape
    model = _model(family).eval()
    ids = gate.gate_ids(None, model.config.vocab_size, 40)
    stepwise = gate.forced_logits(DecoderStep(model, with_cache=False, last_only=True),
                                  DecoderStep(model, with_cache=True, last_only=False), ids,
                                  cache_shape(model.config, 1, 64))
    one_pass = gate.teacher_forced(DecoderStep(model, with_cache=False, last_only=False), ids)
    assert one_pass.shape == stepwise.shape == (39, model.config.vocab_size)
    torch.testing.assert_close(one_pass, stepwise, rtol=1e-4, atol=1e-5)


def test_a_gate_too_strict_fails_with_the_numbers():
    with pytest.raises(ValidationError, match=r"int4 model fails the accuracy gate: perplexity \S+ vs \S+ in "
                                              r"float32 \(ratio \S+, limit 1.0001\); greedy agreement"):
        compile_llm(_model("llama"), quantize="int4", max_ppl_ratio=1.0001, min_agreement=1.0, **OPTIONS)


def test_gate_limits_no_build_can_meet_are_refused_before_compiling(monkeypatch):
    """An agreement over 100 %, a ratio of 0 or NaN, or a limit for a float build (which has
    no gate) is a CompilerArgsError naming it, before any graph compiles: such a build
    failed (or silently ignored the limit) only after its graphs had compiled."""
    from kiln.errors import CompilerArgsError
    from kiln.llm import build

    def no_compile(*a, **k):
        raise AssertionError("compiled before the options were checked")
    monkeypatch.setattr(build, "_compile_graphs", no_compile)
    for limits, quantize, message in [
            (dict(min_agreement=75), "int4", "min_agreement is the share .* from 0 to 1 .* got 75"),
            (dict(min_agreement=-0.1), "int8", "got -0.1"),
            (dict(max_ppl_ratio=0), "int4", "max_ppl_ratio is the largest perplexity .* got 0"),
            (dict(max_ppl_ratio=float("nan")), "int4", "got nan"),
            (dict(max_ppl_ratio="1.2"), "int4", "got '1.2'"),
            (dict(min_agreement=True), "int4", "got True"),
            (dict(max_ppl_ratio=1.1), None, "max_ppl_ratio limit the accuracy gate of quantized builds"),
            (dict(max_ppl_ratio=1.1, min_agreement=0.5), None, "max_ppl_ratio and min_agreement limit")]:
        with pytest.raises(CompilerArgsError, match=message):
            compile_llm(_model("llama"), **({"quantize": quantize} if quantize else {}), **limits, **OPTIONS)


def test_int4_of_a_decoder_exported_as_a_large_one(monkeypatch):
    """A real decoder's graphs are too large for the exporter's own optimizer: kiln's
    rewrites and quantization then meet the raw export (constants as nodes, weights behind
    Transpose). The tiny model is forced down that path."""
    from kiln.engines import onnx_model, onnxruntime as ort_engine
    monkeypatch.setattr(onnx_model, "EXPORTER_OPTIMIZE_MAX_OPS", 0)
    llm = compile_llm(_model("llama"), quantize="int4", **OPTIONS, **LIMITS["int4"])
    assert llm.meta["accuracy_gate"]["passed"]
    blob = llm.decode[1]._artifact.blobs[llm.decode[1].manifest["partitions"][0]["blob"]]
    rewritten = ort_engine.header_of(blob)["rewritten"]
    assert rewritten["rms_norm"] >= 2 and rewritten["transpose"] >= 7, rewritten


def test_prefill_auto_cast_bf16_computes_the_prefill_in_bf16_where_the_cpu_does(monkeypatch):
    """``prefill_auto_cast="bf16"``: the prefill graph goes to OpenVINO with bf16 as its
    inference precision (as OpenVINO GenAI runs on such CPUs), the decode graphs stay as they
    were, and the build passes its gate. Checked with the CPU's bf16 support faked either way:
    the OpenVINO build is asked for bf16 whether or not this CPU has it (OpenVINO then computes
    in f32), so the test runs on every machine."""
    from kiln.engines import openvino as ov_engine
    from kiln.host import target
    seen = []
    real = ov_engine._header_config

    def recording(header, **extra):
        seen.append(header["precision"])
        return real(header, **extra)
    monkeypatch.setattr(ov_engine, "_header_config", recording)
    monkeypatch.setattr(target, "native", lambda cast: cast == "bf16")
    llm = compile_llm(_model("llama"), quantize="int8", prefill_auto_cast="bf16", **OPTIONS)
    assert llm.meta["accuracy_gate"]["passed"]
    prefill = next(iter(llm.prefill.values()))
    assert [e for e, _ in prefill.manifest["engines"]] == ["openvino"]
    assert "bf16" in seen
    assert all(e == "onnxruntime" for m in llm.decode.values() for e, _ in m.manifest["engines"])
    assert len(llm.generate([[5, 17, 3]], 6, stop_at_eos=False)[0]) == 6


def test_prefill_auto_cast_is_refused_where_it_cannot_help(monkeypatch):
    from kiln.errors import CompilerArgsError
    from kiln.host import target
    with pytest.raises(CompilerArgsError, match="applies to quantized builds"):
        compile_llm(_model("llama"), prefill_auto_cast="bf16", **OPTIONS)
    with pytest.raises(CompilerArgsError, match="only 'bf16'"):
        compile_llm(_model("llama"), quantize="int8", prefill_auto_cast="fp16", **OPTIONS)
    monkeypatch.setattr(target, "native", lambda cast: False)
    with pytest.raises(CompilerArgsError, match="does not compute bf16 natively"):
        compile_llm(_model("llama"), quantize="int8", prefill_auto_cast="bf16", **OPTIONS)


def test_int4_keeps_a_q8_0_head_exactly_and_reads_the_tied_embedding_from_it(monkeypatch):
    """An int4 build's output projection is int8 on GGUF's Q8_0 grid (scale max|w|/127), so
    a head that came from a Q8_0 file keeps the file's values; the tied token embedding is
    then read from those blocks (kiln.engines.ort_tied) instead of a float copy of the
    matrix in every graph, and nothing the model computes changes."""
    import numpy as np
    import transformers

    from kiln.engines import onnxruntime as ort_engine, ort_tied
    from tests.test_llm_decoder import COMMON
    torch_ = pytest.importorskip("torch")
    torch_.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True))
    for p in model.parameters():
        torch_.nn.init.normal_(p, std=0.3)
    rng = np.random.default_rng(0)       # the embedding as a Q8_0 file holds it
    k = rng.integers(-127, 128, (97, 1, 32))
    k[:, :, 0] = 127
    d = rng.uniform(0.002, 0.02, (97, 1, 1)).astype(np.float16).astype(np.float32)
    with torch_.no_grad():
        model.model.embed_tokens.weight.copy_(torch_.from_numpy((k * d).reshape(97, 32).astype(np.float32)))
    model.generation_config.eos_token_id = None

    def build():
        return compile_llm(model, quantize="int4", cache=False, **OPTIONS, **LIMITS["int4"])

    def ops(llm):
        blob = llm.decode[1]._artifact.blobs[llm.decode[1].manifest["partitions"][0]["blob"]]
        graph = ort_engine.graph_of(blob).graph
        floats = [i for i in graph.initializer if list(i.dims) == [97, 32] and i.data_type == 1]
        return {n.op_type for n in graph.node}, floats

    shared = build()
    kinds, floats = ops(shared)
    assert "GatherBlockQuantized" in kinds and "Gather" not in kinds and not floats
    # the record counts the head's Q8_0 blocks as such, and the build still reads as int4
    from kiln.compiler import quantized
    record = shared.decode[1].manifest["quantized"]
    assert record["blocks"] == {"Q8_0 (kiln's, the file's grid)": 1}, record
    assert quantized.label(record, "int4") == "int4"
    monkeypatch.setattr(ort_tied, "share_embedding", lambda m: 0)
    apart = build()
    kinds, floats = ops(apart)
    assert "Gather" in kinds and floats
    assert shared.meta["accuracy_gate"] == apart.meta["accuracy_gate"]
    prompts = [[5, 17, 3], [60, 2, 2, 9, 41]]
    assert shared.generate(prompts, 12, stop_at_eos=False) == apart.generate(prompts, 12, stop_at_eos=False)


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_quantizing_without_value_infos_gives_the_same_model(monkeypatch, bits):
    """ONNX Runtime's weight-only quantizer scans the graph's value infos for each product
    (a rank it uses only for weights of more than two dimensions); kiln sets them aside
    while it runs. The quantized model is the same, byte for byte, and keeps its value
    infos."""
    import contextlib

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from kiln.engines import ort_quantize
    rng = np.random.default_rng(0)
    nodes, inits, infos, x = [], [], [], "x"
    for i in range(3):          # a chain of products, two of them reading one activation
        w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{i}")
        inits.append(w)
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        infos.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 64]))
        x = f"y{i}" if i != 1 else x
    nodes.append(helper.make_node("Add", ["y1", "y2"], ["out"], name="add"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 64])], inits,
                              value_info=infos)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    names = [f"mm{i}" for i in range(3)]
    fast = ort_quantize._weight_only(onnx.ModelProto.FromString(model.SerializeToString()), list(names), bits)
    monkeypatch.setattr(ort_quantize, "_value_infos_aside", lambda m: contextlib.nullcontext())
    plain = ort_quantize._weight_only(onnx.ModelProto.FromString(model.SerializeToString()), list(names), bits)
    assert fast.SerializeToString() == plain.SerializeToString()
    assert any(n.op_type == "MatMulNBits" for n in fast.graph.node)
    assert len(fast.graph.value_info) >= len(infos)


def _three_products(seed=0, changed=False):
    """A small graph of three weight products (two reading one activation), its weights'
    input dim a multiple of 32 so every quantizer path runs: kiln's Q4_1 and Q8_0 blocks
    and ONNX Runtime's own; ``changed``: one weight differs in one value."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    nodes, inits, infos, x = [], [], [], "x"
    for i in range(3):
        w = rng.standard_normal((64, 64 + 32 * i)).astype(np.float32)
        if changed and i == 1:
            w[5, 7] += 0.25
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        infos.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 64 + 32 * i]))
        x = "y0" if i == 0 else x
    nodes.append(helper.make_node("Concat", ["y1", "y2"], ["out"], name="cat", axis=-1))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 224])], inits,
                              value_info=infos)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("bits", [8, 4])
def test_weights_quantized_once_for_several_graphs_give_the_same_models(bits):
    """An LLM's graphs each hold every weight; within ``ort_once.sharing()`` (a compile's
    graphs, ``reuse_captures``) each weight's blocks are computed once. The quantized models
    are the same bytes as each quantized on its own, a second graph holding the same
    weights computes nothing new, and a weight that differs in one value is quantized
    afresh (one new entry), never handed another's blocks."""
    import onnx

    from kiln.engines import ort_once, ort_quantize
    names = ["mm0", "mm1", "mm2"]

    def quantized(model):
        return ort_quantize._weight_only(onnx.ModelProto.FromString(model.SerializeToString()),
                                         list(names), bits).SerializeToString()

    same, changed = _three_products(), _three_products(changed=True)
    alone = quantized(same), quantized(changed)
    assert alone[0] != alone[1]
    with ort_once.sharing():
        memo = ort_once._MEMOS[-1]
        assert quantized(same) == alone[0]
        computed = len(memo)
        assert computed >= 2                # the head's Q8_0 (int4) or ONNX Runtime's int8, and the rest
        assert quantized(same) == alone[0] and len(memo) == computed
        assert quantized(changed) == alone[1] and len(memo) == computed + 1
    assert not ort_once.active()
