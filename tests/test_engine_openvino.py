"""The OpenVINO engine: compiled models match eager PyTorch, save/load, threads, host fallback."""
import copy

import pytest

pytest.importorskip("openvino")

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import engines  # noqa: E402
from kiln.host import target as host_target  # noqa: E402
from tests import models  # noqa: E402
from tests.conftest import assert_close, run_py  # noqa: E402

ATOL = RTOL = 1e-4


def _check_manifest(compiled, partitions=1):
    import openvino
    parts = compiled.manifest["partitions"]
    assert len(parts) == partitions
    for p in parts:
        assert p["engine"] == "openvino"
        assert p["engine_version"] == openvino.__version__
        assert p["blob"].endswith(".ovblob")
    assert compiled.manifest["validation"]["passed"]


@pytest.fixture(scope="module")
def mlp_ov():
    model, x = models.mlp()
    return model, x, kiln.trace(model, x, engine="openvino")


def test_mlp_matches_eager(mlp_ov):
    model, x, compiled = mlp_ov
    assert_close(compiled(x), model(x).detach(), atol=ATOL, rtol=RTOL)
    x2 = torch.randn_like(x)
    assert_close(compiled(x2), model(x2).detach(), atol=ATOL, rtol=RTOL)
    _check_manifest(compiled)
    assert compiled.report["support_percentage"] == 100.0


def test_outputs_are_not_reused_between_calls(mlp_ov):
    """An infer request reuses its output buffers; results handed out must not change."""
    model, x, compiled = mlp_ov
    first = compiled(x)
    kept = first.clone()
    compiled(torch.randn_like(x) * 10)
    assert torch.equal(first, kept)


def test_cnn_matches_eager():
    model, x = models.cnn()
    compiled = kiln.trace(model, x, engine="openvino")
    assert_close(compiled(x), model(x).detach(), atol=ATOL, rtol=RTOL)
    _check_manifest(compiled)


@pytest.fixture(scope="module")
def bert_ov():
    model, inputs = models.tiny_bert(), models.bert_inputs()
    return model, inputs, kiln.trace(model, inputs, engine="openvino")


def test_tiny_bert_matches_eager_with_int64_inputs(bert_ov):
    model, inputs, compiled = bert_ov
    ref = model(**inputs)
    out = compiled(**inputs)
    assert_close(out.last_hidden_state, ref.last_hidden_state.detach(), atol=ATOL, rtol=RTOL)
    assert_close(out.pooler_output, ref.pooler_output.detach(), atol=ATOL, rtol=RTOL)
    # the whole model, int64 index bookkeeping included, is one OpenVINO partition
    _check_manifest(compiled)
    assert compiled.report["support_percentage"] == 100.0


def test_multi_input_multi_output_order_and_dtypes():
    """Inputs and outputs reach OpenVINO in the partition's order, with their dtypes."""

    class MIMO(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, b, ids, a, flag):
            h = self.lin(a)
            return {"diff": a - b, "ids": ids.flip(-1), "sum": h + b, "pos": h > 0,
                    "mean": h.mean(), "pick": torch.where(flag, a, b), "count": flag.sum(-1)}

    torch.manual_seed(0)
    model = MIMO().eval()
    args = (torch.randn(2, 4), torch.randint(-2**31, 2**31, (2, 4)), torch.randn(2, 4),
            torch.rand(2, 4) > 0.5)
    compiled = kiln.trace(model, args, engine="openvino")
    _check_manifest(compiled)
    args2 = (torch.randn(2, 4), torch.randint(0, 9, (2, 4)), torch.randn(2, 4), torch.rand(2, 4) > 0.5)
    for call in (args, args2):
        out, ref = compiled(*call), model(*call)
        for k in ref:
            assert out[k].dtype == ref[k].dtype, k
            assert_close(out[k], ref[k].detach(), atol=ATOL, rtol=RTOL)
    # OpenVINO's CPU plugin computes int64 in int32: values int32 cannot hold are refused
    # at call time, not silently wrapped
    with pytest.raises(kiln.InputError, match="outside int32"):
        compiled(args[0], args[1] + 2**40, args[2], args[3])


def test_ops_openvino_would_change_stay_on_host():
    """int64 arithmetic that could leave int32 and float64 run on the host; float16 goes to
    OpenVINO where the CPU computes it (OpenVINO computes it in float32, held to eager at
    float16's floor), and stays on the host where kiln emulates its rounding."""

    class Dtypes(torch.nn.Module):
        def forward(self, ids, x):
            return (ids * 3, ids.flip(-1), torch.arange(4) + 2, torch.exp(x.double()),
                    torch.relu(x.half()), x * 2)

    report = kiln.analyze(Dtypes(), (torch.randint(0, 100, (2, 4)), torch.randn(2, 4)),
                          engine="openvino")
    reasons = {u["op"]: u["reason"] for u in report.unsupported_ops}
    assert "int64 arithmetic" in reasons["aten::mul.Tensor"]        # ids * 3: ids is unbounded
    assert "float64" in reasons["aten::exp"]
    if host_target.native("fp16"):
        assert "aten::relu" not in reasons and report.supported_ops["aten::relu"] == 1
    else:                                                           # its rounding emulated on the host
        assert "float16" in reasons["aten::relu"]
    assert report.supported_ops["aten::add.Tensor"] == 1            # arange(4) + 2 fits int32
    assert report.supported_ops["aten::flip"] == 1                  # moves values, checked at call
    assert report.supported_ops["aten::mul.Tensor"] == 1            # x * 2 in float32


class _NarrowInts(torch.nn.Module):
    def forward(self, a, u8):
        return a // 3, a.amax(-1), a.flip(-1), u8 + 200


def test_narrow_integer_arithmetic_stays_off_openvino_and_answers_as_eager():
    """OpenVINO computes int32 arithmetic in float32 and saturates uint8 sums: ``a // 3`` past
    2^24 came out rounded, a row maximum of 2^31 - 1 came out -2^31, ``u8 + 200`` came out
    255 where eager wraps to 44; small example values passed the check (found by probing,
    12-03). Such ops now run elsewhere; moving values (``flip``) stays on OpenVINO."""
    example = (torch.tensor([[1, 5, 7, 9]], dtype=torch.int32), torch.tensor([5, 6, 7, 8], dtype=torch.uint8))
    report = kiln.analyze(_NarrowInts(), example, engine="openvino")
    reasons = {u["op"]: u["reason"] for u in report.unsupported_ops}
    assert "int32 arithmetic" in reasons["aten::div.Tensor_mode"]                # a // 3 as captured
    assert "int32 arithmetic" in reasons["aten::amax"] and "uint8 arithmetic" in reasons["aten::add.Tensor"]
    assert report.supported_ops["aten::flip"] == 1
    compiled = kiln.trace(_NarrowInts(), example, engine="openvino", cache=False, quiet=True)
    big = (torch.tensor([[2**30, -2**30, 2**31 - 1, 16777217]], dtype=torch.int32),
           torch.tensor([100, 200, 3, 4], dtype=torch.uint8))
    for got, want in zip(compiled(*big), _NarrowInts()(*big)):
        assert torch.equal(got, want), (got, want)


class _TwoIndices(torch.nn.Module):
    def forward(self, x, i, j):
        return torch.softmax(x, -1)[i, j] * 2


def test_indexing_with_two_index_tensors_counts_negative_ones_from_the_end_on_openvino():
    """OpenVINO read ``p[i, j]`` with a negative ``j`` from the previous row (found by probing,
    12-03; the example's indices were nonnegative, so the check passed). The graph OpenVINO
    gets writes such indices as ``i + n``; the indexing stays on OpenVINO."""
    x = torch.randn(10, 4)
    example = (x, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    compiled = kiln.trace(_TwoIndices(), example, engine="openvino", cache=False, quiet=True)
    assert [p["engine"] for p in compiled.manifest["partitions"]] == ["openvino"]
    report = kiln.analyze(_TwoIndices(), example, engine="openvino")
    assert not report.unsupported_ops and report.supported_ops["aten::index.Tensor"] == 1
    for j in ([-1, -2, -4], [3, -1, 0]):
        given = (x, torch.tensor([1, 2, 3]), torch.tensor(j))
        torch.testing.assert_close(compiled(*given), _TwoIndices()(*given), rtol=1e-5, atol=1e-6)


def test_compile_refuses_partitions_drawn_by_another_engine():
    """-O3 hands every engine the partitions the primary engine drew: OpenVINO must refuse
    ops it would change (so kiln moves on to the next engine) instead of compiling them."""
    from kiln.graph.capture import capture
    from kiln.compiler.options import CompileOptions

    class IntMath(torch.nn.Module):
        def forward(self, ids):
            return ids * 3 + 1

    captured = capture(IntMath(), (torch.randint(0, 9, (2, 4)),))
    with pytest.raises(RuntimeError, match="int64 arithmetic"):
        engines.get("openvino").compile(captured.graph_module, captured.example_inputs,
                                         CompileOptions(engine="openvino"))


def _only_openvino(compiled):
    parts = compiled.manifest["partitions"]
    assert [p["engine"] for p in parts] == ["openvino"], [p.get("candidates") for p in parts]
    steps = compiled.manifest["program"]["steps"]
    assert all("partition" in s for s in steps), steps          # nothing left on the host


def test_bfloat16_on_a_cpu_that_emulates_it_stays_on_the_host(monkeypatch):
    """Where kiln emulates bf16 its rounding stays on the host: OpenVINO would compute in float32."""
    from kiln.engines import ov_dtypes
    from kiln.graph.capture import capture
    monkeypatch.setattr(ov_dtypes.host_target, "native", lambda kind: False)
    model = torch.nn.Linear(4, 4).bfloat16()
    graph = capture(model, (torch.randn(2, 4, dtype=torch.bfloat16),)).graph_module
    linear = next(n for n in graph.graph.nodes if n.op == "call_function" and "addmm" in str(n.target))
    assert "emulates" in engines.get("openvino").supports(linear)


@pytest.mark.skipif(not host_target.native("bf16"), reason="kiln emulates bf16 on this CPU and keeps it off OpenVINO")
def test_bfloat16_runs_on_openvino_and_crosses_as_its_bits():
    """A bf16 model (bf16 in, bf16 out, a LayerNorm between) is one OpenVINO partition:
    the plugin computes it in float32 at kiln's pinned precision, so it is held to eager at
    bf16's floor (and here is within 1.25x eager's distance from the float32 answer). Its
    tensors cross the boundary as their bits (NumPy has no bfloat16); before, every bf16
    op stayed on the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8)).bfloat16().eval()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    compiled = kiln.trace(model, (x,), engine="openvino", cache=False, quiet=True)
    _only_openvino(compiled)
    with torch.no_grad():
        wide = copy.deepcopy(model).float()(x.float())
        for x_ in (x, torch.randn(4, 16, dtype=torch.bfloat16) * 3):
            want, got = model(x_), compiled(x_)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    eager_error = (model(x).float() - wide).abs().max().item()
    assert (compiled(x).float() - wide).abs().max().item() <= 1.25 * eager_error + 1e-6


def test_training_graph_ops_openvinos_frontend_cannot_read_as_captured():
    """A training step's forward reads ``native_layer_norm``'s mean and deviation, a gradient
    clip calls ``vector_norm(x, 2.0)`` with its other arguments at their defaults, and an
    embedding's gradient writes float values at int64 indices: OpenVINO's frontend failed to
    convert the first two ("Index: 1 is out of bounds", "num_inputs >= min_inputs") and kiln
    kept the third on the host (int64 arithmetic). Now each runs on OpenVINO, as eager."""
    aten = torch.ops.aten

    class Step(torch.nn.Module):
        def forward(self, x, w, ids):
            y, mean, rstd = aten.native_layer_norm(x, [8], w, None, 1e-5)
            total = torch.linalg.vector_norm(y, 2.0)
            grad = torch.zeros(10, 8).index_put([ids], y, accumulate=True)
            return y * rstd + mean, total, grad

    torch.manual_seed(0)
    args = (torch.randn(6, 8), torch.randn(8), torch.tensor([1, 3, 3, 0, 9, 1]))
    compiled = kiln.trace(Step(), args, engine="openvino", cache=False, quiet=True)
    _only_openvino(compiled)
    for got, want in zip(compiled(*args), Step()(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 2, 2, 2, 5, 9])
    for got, want in zip(compiled(args[0], args[1], ids), Step()(args[0], args[1], ids)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_custom_op_falls_back_to_host():
    model, x = models.custom_op()
    compiled = kiln.trace(model, x, engine="openvino")
    assert_close(compiled(x), model(x).detach(), atol=ATOL, rtol=RTOL)
    _check_manifest(compiled, partitions=2)
    host = [s["op"] for s in compiled.manifest["program"]["steps"] if "op" in s]
    assert host == ["kilntest::odd_scale.default"]
    unsupported = compiled.report["unsupported_ops"]
    assert [u["op"] for u in unsupported] == ["kilntest::odd_scale"]
    assert "op table" in unsupported[0]["reason"]


def test_concurrent_calls(mlp_ov, bert_ov):
    from concurrent.futures import ThreadPoolExecutor
    model, _, compiled = mlp_ov
    xs = [torch.randn(2, 16) for _ in range(64)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(compiled, xs))
    for x, y in zip(xs, outs, strict=True):
        assert_close(y, model(x).detach(), atol=ATOL, rtol=RTOL)
    # longer calls, so that they really overlap
    bert, inputs, compiled = bert_ov
    calls = [{**inputs, "input_ids": torch.randint(0, 120, inputs["input_ids"].shape)} for _ in range(12)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda kw: compiled(**kw).last_hidden_state, calls))
    for kw, y in zip(calls, outs, strict=True):
        assert_close(y, bert(**kw).last_hidden_state.detach(), atol=ATOL, rtol=RTOL)


def test_runtime_threads_reach_openvino(mlp_ov):
    from kiln.runtime.options import RuntimeOptions
    _, _, compiled = mlp_ov
    blob = compiled._artifact.blobs[compiled.manifest["partitions"][0]["blob"]]
    runner = engines.get("openvino").load(blob, RuntimeOptions(threads=1))
    assert runner.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    # pinned, not left to OpenVINO (which picks bf16 on CPUs that have it)
    import openvino
    assert runner.compiled.get_property("INFERENCE_PRECISION_HINT") == openvino.Type.f32


def test_save_load_in_fresh_process(bert_ov, tmp_path):
    model, inputs, compiled = bert_ov
    path = tmp_path / "bert.kiln"
    compiled.save(path)
    torch.save(inputs, tmp_path / "inputs.pt")
    torch.save(model(**inputs).last_hidden_state.detach(), tmp_path / "ref.pt")
    code = f"""
import sys, torch, kiln
m = kiln.load({str(path)!r})
inputs = torch.load({str(tmp_path / 'inputs.pt')!r}); ref = torch.load({str(tmp_path / 'ref.pt')!r})
torch.testing.assert_close(m(**inputs).last_hidden_state, ref, atol={ATOL}, rtol={RTOL})
assert m.manifest["partitions"][0]["engine"] == "openvino"
assert not any(k.startswith(('tests', 'transformers')) for k in sys.modules), 'model code was imported'
print('OK')
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_generic_target_stores_portable_ir(tmp_path):
    """--target generic keeps OpenVINO IR (compiled blobs are ISA-specific) and compiles at load."""
    model, x = models.mlp()
    compiled = kiln.trace(model, x, engine="openvino", target="generic")
    blob = compiled._artifact.blobs[compiled.manifest["partitions"][0]["blob"]]
    assert b'"kind": "ir"' in blob[:200]
    compiled.save(tmp_path / "g.kiln")
    loaded = kiln.load(tmp_path / "g.kiln")
    assert_close(loaded(x), model(x).detach(), atol=ATOL, rtol=RTOL)


def test_corrupt_blob_header_is_an_artifact_error():
    from kiln.runtime.options import RuntimeOptions
    with pytest.raises(kiln.ArtifactError, match="bad magic"):
        engines.get("openvino").load(b"not an openvino blob", RuntimeOptions())


def test_loading_from_a_file_maps_the_weights_privately(mlp_ov, tmp_path):
    """A compiled blob loaded from an artifact file is imported from a private,
    copy-on-write mapping of its pages (OpenVINO keeps weights where they lie instead of
    copying them); the answers are the same, and no write through it reaches the file."""
    import mmap

    from kiln.artifact.container import Artifact
    model, x, compiled = mlp_ov
    path = tmp_path / "mlp.kiln"
    compiled.save(path)
    assert_close(kiln.load(path)(x), model(x).detach(), atol=ATOL, rtol=RTOL)
    art = Artifact.load(path)
    name = next(n for n in art.blobs if n.endswith(".ovblob"))
    before = path.read_bytes()
    mapped = art.origin(name).map_private(len(art.blobs[name]))
    assert isinstance(mapped, mmap.mmap) and mapped[:] == bytes(art.blobs[name])
    mapped[0] ^= 0xFF                                    # copy-on-write: this process's page only
    assert path.read_bytes() == before
    mapped.close()
    # a file replaced since the artifact was read (another inode) is not mapped
    path.with_suffix(".new").write_bytes(before)
    path.with_suffix(".new").replace(path)
    assert art.origin(name).map_private(len(art.blobs[name])) is None
