"""Weight-only quantized partitions on OpenVINO (its ONNX frontend reading the ``MatMulNBits``
model ONNX Runtime's engine quantizes, kiln.engines.onnx_model), and -O2 timing every engine
that quantizes a partition (kiln.compiler.selection.times_quantizers)."""
import sys

import pytest
import torch

import kiln
from kiln import engines
from kiln.compiler import selection
from kiln.compiler.options import CompileOptions
from kiln.host import target as host_target
from tests import forkserver

pytest.importorskip("openvino")


class Wide(torch.nn.Module):
    """Products whose input dims are multiples of 32, as MatMulNBits' blocks need."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


X = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
# the model-level gate judges top-1 over 8 rows of 64 outputs: int4 may flip one of them
WEIGHT_ONLY = dict(quantize_mode="weight_only", cache=False, min_top1=0.5)


def _partition(compiled):
    (p,) = compiled.manifest["partitions"]
    return p


@pytest.fixture(scope="module")
def builds():
    model = Wide().eval()
    with torch.no_grad():
        want = model(X)
    out = {}
    for engine in ("openvino", "onnxruntime"):
        for q in ("int4", "int8"):
            out[engine, q] = kiln.trace(model, X, quantize=q, engine=engine, optlevel=1, **WEIGHT_ONLY)
    return model, want, out


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_openvino_runs_the_same_blocks_as_onnx_runtime(builds, quantize):
    model, want, out = builds
    ov, ort = out["openvino", quantize], out["onnxruntime", quantize]
    assert _partition(ov)["engine"] == "openvino" and _partition(ort)["engine"] == "onnxruntime"
    a, b = ov(X), ort(X)
    # the same weight blocks; both quantize each 32-wide group of activations to int8 inside
    # the products, so only that rounding differs
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() < 0.02 * scale, quantize
    cos = torch.nn.functional.cosine_similarity(a.flatten(), want.flatten(), dim=0).item()
    assert 0.99 < cos < 1.0, quantize       # really quantized, and close to float32
    assert not torch.allclose(a, want, atol=1e-6)


def test_openvino_quantized_artifact_loads_in_a_fresh_process(builds, tmp_path):
    _, _, out = builds
    for target in ("native", "generic"):
        compiled = (out["openvino", "int4"] if target == "native" else
                    kiln.trace(Wide().eval(), X, quantize="int4", engine="openvino", optlevel=1,
                               target="generic", **WEIGHT_ONLY))
        path = tmp_path / f"wide-{target}.kiln"
        compiled.save(path)
        torch.save(X, tmp_path / "x.pt")
        code = ("import sys, torch, kiln; m = kiln.load(sys.argv[1]); "
                "torch.save(m(torch.load(sys.argv[2])), sys.argv[3])")
        forkserver.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                       check=True, timeout=300)
        assert torch.equal(torch.load(tmp_path / "y.pt"), compiled(X)), target


class QKV(torch.nn.Module):
    """Three products of one input (an attention block's query, key and value)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


def test_products_sharing_an_input_are_joined_for_onnx_runtime_and_left_apart_for_openvino():
    """ONNX Runtime's engine joins them into one MatMulNBits (fewer nodes); OpenVINO gets
    them apart, because it split a joined product's output with a reference kernel and
    layout reorders (SmolLM2's bf16 int8 prefill 98.9 -> 79.5 ms apart). Both still give
    eager PyTorch's answer within the quantization's rounding."""
    import collections

    from kiln.engines import onnxruntime as ort_engine
    model = QKV().eval()
    with torch.no_grad():
        want = model(X)
    ops = {}
    for engine in ("openvino", "onnxruntime"):
        compiled = kiln.trace(model, X, quantize="int8", engine=engine, optlevel=1, **WEIGHT_ONLY)
        runner = compiled.program.partitions[0]
        if engine == "openvino":
            ops[engine] = collections.Counter(op.get_rt_info()["layerType"].astype(str)
                                              for op in runner.compiled.get_runtime_model().get_ops())
        else:
            blob = compiled._artifact.blobs[_partition(compiled)["blob"]]
            ops[engine] = collections.Counter(n.op_type for n in ort_engine.graph_of(blob).graph.node)
        cos = torch.nn.functional.cosine_similarity(compiled(X).flatten(), want.flatten(), dim=0).item()
        assert cos > 0.999, engine
    assert ops["onnxruntime"]["MatMulNBits"] == 1 and ops["onnxruntime"]["Split"] == 1
    fully_connected = sum(n for op, n in ops["openvino"].items() if op.startswith("FullyConnected"))
    assert fully_connected == 3 and not any(op.endswith("Split") for op in ops["openvino"]), ops["openvino"]


def test_o2_times_every_engine_that_quantizes_and_keeps_the_fastest():
    compiled = kiln.trace(Wide().eval(), X, quantize="int4", **WEIGHT_ONLY)
    p = _partition(compiled)
    built = {c["engine"]: c for c in p["candidates"] if c["status"] in ("ok", "dropped")}
    assert set(built) == {"openvino", "onnxruntime"}
    # each was built and checked; one whose first calls were already clearly slower is dropped
    timed = {name: c["latency_ms"] for name, c in built.items() if c["status"] == "ok"}
    assert p["engine"] == min(timed, key=timed.get)
    for c in built.values():
        if c["status"] == "dropped":
            assert c["probe_ms"] > 0 and "dropped:" in c["note"]
    assert p["choice"] == "fastest measured latency of the engines that quantize it (-O2)"
    # -O1 takes the first engine that builds it, untimed
    first = _partition(kiln.trace(Wide().eval(), X, quantize="int4", optlevel=1, **WEIGHT_ONLY))
    assert [c["engine"] for c in first["candidates"]] == ["onnxruntime"] and "latency_ms" not in first


def test_onnx_runtimes_own_int8_modes_never_go_to_openvino():
    sub = torch.fx.symbolic_trace(Wide())
    for mode, expected in (("dynamic", ["onnxruntime"]), ("static", ["onnxruntime"]),
                           ("weight_only", ["onnxruntime", "openvino"])):
        opts = CompileOptions(quantize="int8", quantize_mode=mode, device="cpu")
        order = selection.candidate_order(opts, sub)
        assert sorted(n for n in order if engines.describe(n).quantizes) == expected, mode
    # and an OpenVINO build asked for such a mode by name is a clear error, not an fp32 model
    with pytest.raises(kiln.CompilerArgsError, match=r"^openvino \(engine='openvino' was named\) cannot quantize to "
                                                     r"int8 with quantize_mode='dynamic'; engines that can: onnxruntime"):
        kiln.trace(Wide().eval(), X, quantize="int8", quantize_mode="dynamic", engine="openvino", cache=False)


def test_auto_cast_to_a_type_only_openvino_computes_natively_with_dynamic_int8_is_said_so():
    """Where OpenVINO computes bf16/fp16 natively, --auto-cast sends the graph to it; with
    quantize='int8' (dynamic, ONNX Runtime's mode) the error said "engine='openvino' was
    named" to a user who named none. Where neither type is native, kiln emulates it on ONNX
    Runtime, which quantizes dynamically: that build is compared with eager instead."""
    from kiln.host import target
    native = [t for t in ("fp16", "bf16") if target.native(t) and engines.native_engine(t, "cpu") == "openvino"]
    flags = f"--auto-cast matmult --auto-cast-type {(native or ['bf16'])[0]}"
    if not native:
        compiled = kiln.trace(Wide().eval(), X, quantize="int8", compiler_args=flags, cache=False)
        assert compiled.manifest["quantized"]["float"] == 0 and compiled.manifest["validation"]["passed"]
        return
    with pytest.raises(kiln.CompilerArgsError, match=r"OpenVINO computes \w+ natively on this CPU but quantizes only "
                                                     r"weight_only; use quantize_mode='weight_only'") as e:
        kiln.trace(Wide().eval(), X, quantize="int8", compiler_args=flags, cache=False)
    assert "was named" not in str(e.value)
    # the way the message gives (this random model's 8 rows agree 7 of 8 on top-1 in fp16)
    compiled = kiln.trace(Wide().eval(), X, quantize="int8", quantize_mode="weight_only", compiler_args=flags,
                          min_top1=0.5, cache=False)
    assert [p["engine"] for p in compiled.manifest["partitions"]] == ["openvino"]
    assert compiled.manifest["quantized"]["quantized"] > 0 and compiled.manifest["quantized"]["float"] == 0


def test_an_llms_prefill_is_timed_on_each_engine_and_its_batch_graphs_share_one():
    transformers = pytest.importorskip("transformers")
    from kiln.llm.build import compile_llm, graph_options
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    llm = compile_llm(model, batch_size=2, context_buckets=(16,), cache_length=32, quantize="int4", cache=False,
                      workers=1, max_ppl_ratio=1e9, min_agreement=0.0)
    (prefill,) = llm.prefill[16].manifest["partitions"]
    assert {c["engine"] for c in prefill["candidates"] if c["status"] in ("ok", "dropped")} == {"onnxruntime",
                                                                                            "openvino"}
    # a batch's rows run through the decode graphs: one engine for all, whatever each would win
    engines_of = {b: {p["engine"] for p in g.manifest["partitions"]} for b, g in llm.decode.items()}
    assert engines_of == {1: {"onnxruntime"}, 2: {"onnxruntime"}}
    # both kept where ONNX Runtime's kernels compute a row alike at 1 and 2 rows (AVX-512 machines
    # here); on an AVX2 EPYC its 4-bit product differs, and the 1-row graph is dropped, not used
    report = llm.batch_invariance
    assert not report["row_by_row"] and report["decode_rows"] in ([1, 2], [2]), report
    assert report["dropped"] == [1] if report["decode_rows"] == [2] else report["invariant"], report
    jobs = [("prefill 16", {}, ()), ("decode 2x32", {}, ()), ("verify 3", {}, ())]
    assert [o.get("engine") for o in graph_options(jobs, {"quantize": "int8"})] == [None, "onnxruntime",
                                                                                    "onnxruntime"]
    assert graph_options(jobs, {"quantize": "int8", "engine": "openvino"}) == [{"quantize": "int8",
                                                                                 "engine": "openvino"}] * 3
    assert graph_options(jobs, {}) == [{}] * 3


class WideWithInt64(Wide):
    def forward(self, x, idx):
        return super().forward(x) + (idx * idx).unsqueeze(-1).float()     # int64 products: may leave int32


def test_int64_arithmetic_stays_off_openvino_on_the_onnx_road_too():
    idx = torch.arange(8)
    # partitions are cut by the first engine's rules (ONNX Runtime's keeps the int64 product in);
    # timed at -O2 on OpenVINO too, the build is refused and the refusal recorded
    p = _partition(kiln.trace(WideWithInt64().eval(), (X, idx), quantize="int4", **WEIGHT_ONLY))
    assert p["engine"] == "onnxruntime"
    (refused,) = [c for c in p["candidates"] if c["engine"] == "openvino"]
    assert refused["status"] == "failed" and "int64 arithmetic" in refused["note"]


def _int4_onnx(weight):
    """A one-product ONNX model with kiln's int4 blocks (ort_int4: MatMulNBits plus the
    offset product), as ONNX Runtime's engine writes them."""
    import onnx
    from onnx import helper, numpy_helper
    from kiln.engines import ort_int4
    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, n])],
        [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert ort_int4.apply(model, ["mm"], 4) == []
    return model


def test_offset_products_fold_into_float_zero_points_for_openvino():
    """OpenVINO gets each block-with-a-minimum product as one MatMulNBits with float zero
    points (kiln.engines.ov_zero_points): the weights it stands for are the blocks' own to
    float32 rounding, the block sums and offset products are gone, and a block whose scale
    is 0 (no zero point can stand for it) is left as two products."""
    import numpy as np
    from onnx import numpy_helper
    from kiln.engines import ort_int4, ov_zero_points
    weight = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    model = _int4_onnx(weight)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    want = ort_int4.dequantized(inits["mm/kiln_int4/q"], inits["mm/kiln_int4/scales"], inits["mm/kiln_int4/offsets"])
    assert ov_zero_points.fold(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMulNBits"] and list(model.graph.node[0].output) == ["y"], ops
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    packed, scales = inits["mm/kiln_int4/q"], inits["mm/kiln_int4/scales"]
    zero = inits["mm/kiln_int4/kiln_zero_points"].reshape(scales.shape)
    u = np.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:2], 32).astype(np.float32)
    got = (scales[..., None] * (u - zero[..., None])).reshape(48, 64).T
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert "mm/kiln_int4/offsets" not in inits
    # a zero scale: left as it was
    model = _int4_onnx(weight)
    scales = next(i for i in model.graph.initializer if i.name == "mm/kiln_int4/scales")
    values = numpy_helper.to_array(scales).copy()
    values.flat[3] = 0.0
    scales.CopyFrom(numpy_helper.from_array(values, scales.name))
    assert ov_zero_points.fold(model) == 0
    assert [n.op_type for n in model.graph.node].count("MatMulNBits") == 1 and len(model.graph.node) == 5


def _fully_connected(compiled):
    import collections
    runner = compiled.program.partitions[0]
    ops = collections.Counter(op.get_rt_info()["layerType"].astype(str)
                              for op in runner.compiled.get_runtime_model().get_ops())
    return sum(n for op, n in ops.items() if op.startswith("FullyConnected")), ops


@pytest.mark.skipif(not host_target.native("bf16"),
                    reason="OpenVINO computes bf16 natively only on CPUs with bf16 instructions")
def test_eight_bit_blocks_with_a_minimum_fold_too():
    """A file's 5- and 6-bit blocks with a minimum (Q5_1, Q5_K, Q6_K) are kept as 8-bit
    MatMulNBits plus the offset product (kiln.engines.ort_blocks); they fold the same way,
    about 128 instead of 8."""
    import numpy as np
    from onnx import helper, numpy_helper
    import onnx
    from kiln.engines import ort_blocks, ov_zero_points
    rng = np.random.default_rng(1)
    u = rng.integers(0, 64, (48, 2, 32)).astype(np.uint8) + 100
    kept = ort_blocks.Kept(8, 32, u, (rng.random((48, 2)) * 0.01 + 1e-3).astype(np.float32),
                           (rng.standard_normal((2, 48)) * 0.1).astype(np.float32), "Q6_K")
    weight = kept.dequantized().astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 48])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    with ort_blocks.keeping({ort_blocks.fingerprint(weight): kept}):
        assert ort_blocks.apply(model, ["mm"], 4) == []
    assert ov_zero_points.fold(model) == 1
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    zero = inits["mm/kiln_kept/kiln_zero_points"].reshape(48, 2)
    got = (kept.scales[..., None] * (u.astype(np.float32) - zero[..., None])).reshape(48, 64).T
    assert np.allclose(got, weight, rtol=1e-5, atol=1e-6 * np.abs(weight).max())


def _timed(fold):
    """A stand-in for this CPU's timing of the fold (kiln.engines.openvino._fold_timing)."""
    return lambda precision, shapes: (("fold", fold), ("fold_ms", 2.0 if not fold else 1.0), ("pair_ms", 1.5))


@pytest.mark.skipif(not host_target.native("bf16"),
                    reason="OpenVINO computes bf16 natively only on CPUs with bf16 instructions (else f32: no fold)")
def test_openvinos_bf16_int4_build_has_one_product_per_linear(builds, monkeypatch):
    """In bf16 the Wide model's two products reach OpenVINO's CPU plugin as two compressed
    FullyConnected operations, not four: both are int4 with a minimum per block (the widest
    stays int8 only in an LLM's step graphs, its output projection: 12-03), folded into float
    zero points (no block sums, no offset products), and the answer stays the f32 build's
    within bf16's rounding, where this CPU runs the folded product faster (here said so by a
    stand-in). The f32 build keeps the offset products."""
    from kiln.engines import openvino as ov_engine
    monkeypatch.setattr(ov_engine, "_fold_timing", _timed(True))
    model, want, out = builds
    compiled = kiln.trace(model, X, quantize="int4", engine="openvino", optlevel=1,
                          compiler_args=["--auto-cast", "all", "--auto-cast-type", "bf16"], **WEIGHT_ONLY)
    count, ops = _fully_connected(compiled)
    assert count == 2 and not any(op.startswith("Reduce") for op in ops), ops
    blob = compiled._artifact.blobs[_partition(compiled)["blob"]]
    assert ov_engine._unpack(blob)[0]["onnx"]["zero_points_folded"] == 2
    cos = torch.nn.functional.cosine_similarity(compiled(X).flatten(), want.flatten(), dim=0).item()
    assert cos > 0.99
    assert _fully_connected(out["openvino", "int4"])[0] == 4       # each product and its offset product


@pytest.mark.skipif(not host_target.native("bf16"),
                    reason="OpenVINO computes bf16 natively only on CPUs with bf16 instructions (else f32: no fold)")
def test_where_the_pair_runs_faster_the_offset_products_stay(builds, monkeypatch):
    """Where this CPU runs the pair faster than the folded product (an AMD EPYC's plugin,
    kiln.engines.ov_zero_points), the bf16 build keeps the block sums and the offset
    product, records the timings it chose by in the partition's header, and answers as the
    folded build does within bf16's rounding."""
    from kiln.engines import openvino as ov_engine
    model, want, _ = builds
    args = dict(quantize="int4", engine="openvino", optlevel=1,
                compiler_args=["--auto-cast", "all", "--auto-cast-type", "bf16"], **WEIGHT_ONLY)
    built = {}
    for fold in (True, False):
        monkeypatch.setattr(ov_engine, "_fold_timing", _timed(fold))
        built[fold] = kiln.trace(model, X, **args)
    count, ops = _fully_connected(built[False])
    assert count == 4 and any(op.startswith("Reduce") for op in ops), ops
    header = ov_engine._unpack(built[False]._artifact.blobs[_partition(built[False])["blob"]])[0]
    assert header["onnx"]["zero_points_folded"] == 0
    assert header["onnx"]["zero_point_timing"] == {"fold": False, "fold_ms": 2.0, "pair_ms": 1.5}
    paired, folded = built[False](X), built[True](X)
    assert (paired - folded).abs().max().item() <= 0.05 * want.abs().max().item()
    cos = torch.nn.functional.cosine_similarity(paired.flatten(), want.flatten(), dim=0).item()
    assert cos > 0.99


@pytest.mark.skipif(not host_target.native("bf16"),
                    reason="the fold is timed for builds OpenVINO computes in bf16, on CPUs that compute it natively")
def test_the_fold_timing_compares_the_same_products():
    """The two models the fold is timed on (kiln.engines.ov_zero_points.probe) compute the
    same chain of products, as pairs and folded, in the graph's proportions of shapes; and
    the timing this CPU gives (no speed asserted) names its choice and both times."""
    import numpy as np
    import onnxruntime as ort
    from kiln.engines import openvino as ov_engine, ov_zero_points
    found = [(4, 64, 96, 6), (4, 96, 64, 3)]
    pair, folded = ov_zero_points.probe(found, limit=6)
    ops = [n.op_type for n in pair.graph.node]
    assert ops.count("MatMulNBits") == 6 and ops.count("ReduceSum") == 6
    assert [n.op_type for n in folded.graph.node].count("MatMulNBits") == 6
    assert not any(n.op_type == "ReduceSum" for n in folded.graph.node)
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    a, b = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x4": x})[0]
            for m in (pair, folded))
    # the pair's main product quantizes its activations to int8 (accuracy level 4); ONNX
    # Runtime computes the folded one in float: ~1e-2 apart, where other weights would be ~1
    assert a.shape == (4, 96) and np.abs(a - b).max() <= 0.03 * np.abs(a).max()
    timing = ov_engine._fold_pays("bf16", found)
    assert set(timing) == {"fold", "fold_ms", "pair_ms"} and timing["fold_ms"] > 0 and timing["pair_ms"] > 0
    assert timing["fold"] == (timing["fold_ms"] <= timing["pair_ms"] / ov_engine.FOLD_MARGIN)


def test_a_fold_timing_that_fails_folds_as_before(monkeypatch):
    """The probe is a measurement: if it cannot run, the build folds as it did before the
    probe existed and says why, rather than failing."""
    from kiln.engines import openvino as ov_engine

    def broken(precision, shapes):
        raise RuntimeError("no probe here")
    monkeypatch.setattr(ov_engine, "_fold_timing", broken)
    assert ov_engine._fold_pays("bf16", [(8, 64, 48, 1)]) == {"fold": True, "probe_failed": "RuntimeError: no probe here"}


def test_shapes_counts_the_products_that_would_fold():
    """The fold's timing is asked about the products that would fold, one entry per shape
    with its rows and count."""
    import numpy as np
    from kiln.engines import ov_zero_points
    weight = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    assert ov_zero_points.shapes(_int4_onnx(weight)) == [(8, 64, 48, 1)]
