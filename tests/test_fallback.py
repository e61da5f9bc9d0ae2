"""Partitioning with host fallback, and its options."""

import contextlib

import pytest
import torch

import kiln
from tests import models
from tests.conftest import assert_close


def test_custom_op_falls_back_to_host_and_matches_eager():
    model, x = models.custom_op()
    compiled = kiln.trace(model, x)
    assert_close(compiled(x), model(x).detach())
    program = compiled.manifest["program"]
    host = [s["op"] for s in program["steps"] if "op" in s]
    assert host == ["kilntest::odd_scale.default"]
    assert len(compiled.manifest["partitions"]) == 2   # before and after the host op
    assert_close(compiled(x * 3), model(x * 3).detach())


def test_fallback_false_names_op_and_line():
    model, x = models.custom_op()
    with pytest.raises(kiln.UnsupportedOpError) as info:
        kiln.trace(model, x, fallback=False)
    msg = str(info.value)
    assert "kilntest::odd_scale" in msg
    assert "models.py" in msg and "odd_scale(h)" in msg


def test_min_partition_size_moves_small_partitions_to_host():
    model, x = models.custom_op()
    compiled = kiln.trace(model, x, min_partition_size=3)
    # partition after the host op has 2 ops (permute, addmm): now on the host too
    assert len(compiled.manifest["partitions"]) == 1
    unsupported = {u["op"]: u for u in compiled.report["unsupported_ops"]}
    assert "aten::addmm" in unsupported
    assert "min_partition_size=3" in unsupported["aten::addmm"]["reason"]
    assert_close(compiled(x), model(x).detach())


def test_ops_on_host():
    model, x = models.mlp()
    compiled = kiln.trace(model, x, ops_on_host={"aten::relu"})
    host = [s["op"] for s in compiled.manifest["program"]["steps"] if "op" in s]
    assert host == ["aten::relu.default"]
    assert len(compiled.manifest["partitions"]) == 2
    assert_close(compiled(x), model(x).detach())


def test_nothing_on_device_warns_and_still_runs():
    class OnlyCustom(torch.nn.Module):
        def forward(self, x):
            return models.odd_scale(x)

    x = torch.randn(3)
    with pytest.warns(UserWarning, match="no operator .* is placed on the onnxruntime engine"):
        compiled = kiln.trace(OnlyCustom(), x)
    assert compiled.manifest["partitions"] == []
    assert_close(compiled(x), x * 2 + 1)
    assert compiled.report["notes"]


def test_host_constants_survive_save_load(tmp_path):
    class HostWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5))

        def forward(self, x):
            return models.odd_scale(self.w) + x

    model = HostWeight().eval()
    x = torch.randn(5)
    compiled = kiln.trace(model, x, ops_on_host={"aten::add"})
    path = tmp_path / "hw.kiln"
    compiled.save(path)
    loaded = kiln.load(path)
    assert_close(loaded(x), model(x).detach())


def test_host_ops_with_named_overloads_survive_save_load(tmp_path):
    """aten::add.Tensor on the host is stored by schema name + overload and resolves on load."""
    model, x = models.mlp()
    compiled = kiln.trace(model, x, ops_on_host={"aten::addmm"})
    steps = [s["op"] for s in compiled.manifest["program"]["steps"] if "op" in s]
    assert steps == ["aten::addmm.default", "aten::addmm.default"]

    class AddMul(torch.nn.Module):
        def forward(self, a, b):
            return (a + b) * b

    a, b = torch.randn(4), torch.randn(4)
    c = kiln.trace(AddMul(), (a, b), ops_on_host={"aten::add", "aten::mul"})
    ops = [s["op"] for s in c.manifest["program"]["steps"] if "op" in s]
    assert ops == ["aten::add.Tensor", "aten::mul.Tensor"]
    c.save(tmp_path / "am.kiln")
    assert_close(kiln.load(tmp_path / "am.kiln")(a, b), (a + b) * b)


def test_whole_graph_goes_to_inductor_when_the_first_engine_would_leave_ops_on_the_host():
    """``whole_graph`` (what the device and torch.compile backend use): a graph the first
    engine would split around a host op (lgamma has no ONNX translation) compiles whole
    on Inductor, and still equals eager."""
    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.lgamma(x.relu() + 1.0) * 2.0 + x
    x = torch.rand(4, 8) * 3
    split = kiln.trace(Model(), x, optlevel=1, cache=False)
    assert [s["op"] for s in split.manifest["program"]["steps"] if "op" in s] == ["aten::lgamma.default"]
    whole = kiln.trace(Model(), x, optlevel=1, whole_graph=True, cache=False)
    assert [p["engine"] for p in whole.manifest["partitions"]] == ["inductor"]
    assert not [s for s in whole.manifest["program"]["steps"] if "op" in s]
    assert any("whole_graph" in n for n in whole.report["notes"]), whole.report["notes"]
    assert_close(whole(x), Model()(x))
    from kiln.host import target
    if not target.native("bf16"):        # Inductor would emulate bf16 op by op: no whole graph
        xb = x.bfloat16()
        narrow = kiln.trace(Model(), xb, optlevel=1, whole_graph=True, cache=False, atol=0.05, rtol=0.05)
        assert not any("whole_graph" in n for n in narrow.report["notes"]), narrow.report["notes"]
        # lgamma stays on the host (which other ops join it depends on this CPU's first engine:
        # ONNX Runtime has no bf16 kernels, so on a machine where it comes first all of them do)
        assert "aten::lgamma.default" in [s["op"] for s in narrow.manifest["program"]["steps"] if "op" in s]
        assert_close(narrow(xb).float(), Model()(xb).float(), atol=0.05, rtol=0.05)


@contextlib.contextmanager
def _whole_program_decompositions():
    """The partitions the ONNX export re-traced whole to decompose a few nodes
    (``kiln.engines.ort_export._with_kilns``); kiln decomposes such nodes in place
    (``decomposed_locally``), so the list stays empty where that works."""
    from kiln.engines import ort_export
    calls, original = [], ort_export._with_kilns

    def spy(program, registry):
        calls.append(program)
        return original(program, registry)
    ort_export._with_kilns = spy
    try:
        yield calls
    finally:
        ort_export._with_kilns = original


def test_whole_graph_later_defers_the_whole_graph_only_where_the_partitions_are_few():
    """``whole_graph="later"`` (the device's background compiles): a graph split around one
    host op is planned in its partitions, with the whole-graph engine named for later; one
    split into more than ``LATER_PARTITIONS`` pieces goes whole at once, as with ``True``
    (a bf16 BERT step's 33 pieces were built one by one on Inductor otherwise). Where
    OpenVINO takes every op (here not: ``lgamma``), the whole graph goes to it first, a build
    of seconds, with Inductor named for later (below)."""
    from kiln.compiler import phases
    from kiln.compiler.driver import make_options
    from kiln.graph.capture import capture
    from kiln.progress import Progress

    class Model(torch.nn.Module):
        def __init__(self, pieces):
            super().__init__()
            self.pieces = pieces

        def forward(self, x):
            for _ in range(self.pieces):
                x = torch.lgamma(x.relu() + 1.0).tanh() * 2.0 + 1.0
            return x
    x = torch.rand(4, 8)
    for pieces, later in ((1, "inductor"), (phases.LATER_PARTITIONS + 1, None)):
        p = phases.plan(capture(Model(pieces), x), make_options(whole_graph="later"), Progress(quiet=True))
        assert p.whole_graph_later == later, (pieces, p.report.notes)
        assert p.engine.name == ("onnxruntime" if later else "inductor"), (pieces, p.report.notes)
        assert len(p.placement.partitions) == (pieces + 1 if later else 1), pieces
    with pytest.raises(kiln.errors.CompilerArgsError, match="whole_graph"):
        make_options(whole_graph="soon")

    class Accumulates(torch.nn.Module):   # an embedding's gradient, too large to sum as a one-hot
        def forward(self, x, ids):          # product: ONNX Runtime's ScatterND races on repeats
            return torch.zeros(5000, 64).index_put([ids], x.relu() * 2.0, accumulate=True).tanh()
    captured = capture(Accumulates(), (torch.rand(60, 64), torch.arange(60) % 7))
    p = phases.plan(captured, make_options(whole_graph="later"), Progress(quiet=True))
    assert p.engine.name == "openvino" and p.whole_graph_later == "inductor", p.report.notes
    assert len(p.placement.partitions) == 1 and not p.placement.unsupported
    assert phases.plan(captured, make_options(whole_graph=False), Progress(quiet=True)).placement.unsupported


def test_a_bf16_model_goes_whole_to_inductor_where_the_cpu_computes_bf16(monkeypatch):
    """A bf16 model, whose bf16 operations the first engine (ONNX Runtime: no bf16 kernels)
    leaves on the host, used to run them there op by op (a bf16 BERT-4L at 0.69-0.94x
    eager around a small ONNX Runtime partition; a bf16 MLP eagerly behind a warning)
    unless ``whole_graph`` was asked for. On a CPU that computes bf16 natively it goes whole
    to Inductor (timed against eager at -O2, as any whole_graph build); where bf16 is
    emulated it stays as it was, since Inductor would compute it op by op too. A float32
    graph is not affected."""
    from kiln.compiler import phases
    from kiln.compiler.driver import make_options
    from kiln.graph.capture import capture
    from kiln.host import target
    from kiln.progress import Progress
    torch.manual_seed(0)
    bf16 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).bfloat16().eval()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    # float32 in, float32 products, then one bf16 product: ONNX Runtime takes the float32 part
    mixed = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), _ToBf16(),
                                torch.nn.Linear(8, 4).bfloat16()).eval()
    fp32 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()

    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    proposals = []
    propose = CapabilityBasedPartitioner.propose_partitions
    monkeypatch.setattr(CapabilityBasedPartitioner, "propose_partitions",
                        lambda self: proposals.append(1) or propose(self))

    def planned(m, inputs, native, **options):
        monkeypatch.setattr(target, "native", lambda kind: native)
        proposals.clear()
        return phases.plan(capture(m, inputs), make_options(**options), Progress(quiet=True))

    for model, inputs in ((bf16, x), (mixed, torch.randn(3, 8))):
        p = planned(model, inputs, native=True)
        assert p.engine.name == "inductor" and p.options.engine_by == "whole_graph", p.report.notes
        assert len(p.placement.partitions) == 1 and not p.placement.unsupported
        assert not proposals            # ONNX Runtime's partitions, never used, were not made
        p = planned(model, inputs, native=False)
        assert p.engine.name == "onnxruntime" and p.placement.unsupported, p.report.notes
        assert proposals                 # made where they are used
        # the device's partitions-first builds: not where they would leave the bf16 work op by op;
        # the whole graph goes to OpenVINO (a build of seconds) first and to Inductor later
        p = planned(model, inputs, native=True, whole_graph="later")
        assert p.engine.name == "openvino" and p.whole_graph_later == "inductor", p.report.notes
        assert len(p.placement.partitions) == 1 and not p.placement.unsupported and not proposals
    assert not planned(bf16, x, native=False).placement.partitions        # eager's, with the warning
    p = planned(fp32, torch.randn(3, 8), native=True)
    assert p.engine.name == "onnxruntime" and not p.placement.unsupported
    # (the build itself is test_onnx_runtime_never_gets_bfloat16_operations's, with whole_graph)


def test_a_bf16_models_whole_graph_that_misses_eager_leaves_the_first_engines_plan(monkeypatch):
    """That whole build is checked against eager like any other; where it misses (Inductor's
    bf16 BERT-base differed from eager's by 6 bf16 ulps at the pooler after 12 layers), the
    compile does not fail, as it did not before the rule: the first engine's plan is
    built instead (here, the host: ONNX Runtime takes none of a bf16 MLP), with a note."""
    from kiln.compiler import driver
    from kiln.host import target
    monkeypatch.setattr(target, "native", lambda kind: True)
    real, planned = driver._build_checked, []

    def missing_whole(plan, *args):
        planned.append(plan.engine.name)
        if plan.narrow_whole:
            raise kiln.ValidationError("output 'y': a stand-in for a bf16 build beyond bf16's floor")
        return real(plan, *args)
    monkeypatch.setattr(driver, "_build_checked", missing_whole)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()).bfloat16().eval()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="entirely on the host"):
        c = kiln.trace(model, x, optlevel=1, cache=False)
    assert planned == ["inductor", "onnxruntime"] and not c.manifest["partitions"]
    assert any("did not match eager" in n and "stand-in" in n for n in c.report["notes"]), c.report["notes"]
    torch.testing.assert_close(c(x), model(x), rtol=0, atol=0)


class _ToBf16(torch.nn.Module):
    def forward(self, x):
        return x.bfloat16()


def test_an_operator_the_onnx_exporter_decomposes_runs_on_onnx_runtime_whole():
    """``aten.squeeze.dims`` has no translation in torch's ONNX registry, but the exporter
    decomposes it into operators that have one: ONNX Runtime takes it, so the graph is one
    ONNX Runtime partition (with ``whole_graph``, not a C++ build on Inductor), equal to
    eager. An operator whose decomposition does not translate (``lgamma``: none at all)
    stays on the host."""
    class Model(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x.squeeze((0, 2))) * 2.0 + x.sum()
    x = torch.randn(1, 3, 1, 4)
    with _whole_program_decompositions() as passes:
        c = kiln.trace(Model(), x, optlevel=1, whole_graph=True, cache=False)
    assert passes == [], "squeeze.dims is decomposed where it stands, not by re-tracing the partition"
    assert c.report["unsupported_ops"] == [], c.report["unsupported_ops"]
    assert [p["engine"] for p in c.manifest["partitions"]] == ["onnxruntime"]
    assert not [s for s in c.manifest["program"]["steps"] if "op" in s]
    torch.testing.assert_close(c(x), Model()(x), rtol=1e-6, atol=1e-6)
    y = torch.randn(1, 3, 1, 4)             # not the example: the squeezed dims are not baked in
    torch.testing.assert_close(c(y), Model()(y), rtol=1e-6, atol=1e-6)

    from torch.fx.experimental.proxy_tensor import make_fx
    from kiln import engines
    ort = engines.get("onnxruntime")
    gm = make_fx(lambda t: torch.ops.aten.squeeze.dims(torch.lgamma(t), [0, 2]), tracing_mode="fake")(x)
    verdict = {str(n.target): ort.supports(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert verdict["aten.squeeze.dims"] is None
    assert "no ONNX translation" in verdict["aten.lgamma.default"]


@pytest.mark.parametrize("case", ["strided", "grouped-dilated-1d", "masked"])
def test_a_convolutions_gradient_runs_on_onnx_runtime_as_convolutions(case):
    """torch has no decomposition of ``aten.convolution_backward`` (a CNN's gradient), so
    it had no ONNX form: kiln's (``kiln.engines.ort_decomps``) writes it as convolutions,
    and the graph is one ONNX Runtime partition equal to eager's gradients, for strides
    that drop rows, groups, dilation and outputs left out; a transposed convolution's
    gradient is still refused with its reason."""
    aten = torch.ops.aten
    dims, stride, padding, dilation, groups, mask = {
        "strided": (2, 2, 1, 1, 1, [True, True, True]),
        "grouped-dilated-1d": (1, 3, 2, 2, 2, [True, True, True]),
        "masked": (2, 1, 0, 1, 1, [False, True, False])}[case]

    class Gradient(torch.nn.Module):
        def forward(self, gy, x, w):
            got = aten.convolution_backward(gy, x, w, [6], [stride] * dims, [padding] * dims, [dilation] * dims,
                                            False, [0] * dims, groups, mask)
            return tuple(g for g in got if g is not None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, *[11] * dims, generator=g)
    w = torch.randn(6, 4 // groups, *[3] * dims, generator=g)
    y = aten.convolution(x, w, None, [stride] * dims, [padding] * dims, [dilation] * dims, False, [0] * dims, groups)
    gy = torch.randn(y.shape, generator=g)
    with _whole_program_decompositions() as passes:
        c = kiln.trace(Gradient(), (gy, x, w), optlevel=1, whole_graph=True, cache=False)
    assert passes == []          # its tuple of gradients (some None) written in place of the node
    assert c.report["unsupported_ops"] == [], c.report["unsupported_ops"]
    assert [p["engine"] for p in c.manifest["partitions"]] == ["onnxruntime"]
    for args in ((gy, x, w), (torch.randn(gy.shape), torch.randn(x.shape), torch.randn(w.shape))):
        torch.testing.assert_close(c(*args), Gradient()(*args), rtol=1e-5, atol=1e-5)

    from torch.fx.experimental.proxy_tensor import make_fx
    from kiln import engines
    wt = torch.randn(4, 6, 3, 3)         # a transposed convolution's weight: [C_in, C_out, k, k]
    yt = aten.convolution(torch.randn(2, 4, 5, 5), wt, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1)
    gm = make_fx(lambda a, b, c: aten.convolution_backward(a, b, c, [6], [1, 1], [0, 0], [1, 1], True, [0, 0], 1,
                                                           [True, True, True]), tracing_mode="fake")(
        torch.randn(yt.shape), torch.randn(2, 4, 5, 5), wt)
    node = next(n for n in gm.graph.nodes if n.target is aten.convolution_backward.default)
    assert "no ONNX translation" in engines.get("onnxruntime").supports(node)


def test_training_mode_batch_norm_on_onnx_runtime_uses_the_batchs_statistics():
    """torch's exporter translates training-mode batch norm to ONNX's
    ``BatchNormalization(training_mode=1)``, which ONNX Runtime's CPU build computes with the
    running statistics, as in evaluation (20 off eager on this batch). kiln decomposes it
    first (``kiln.engines.ort_decomps.decompose_first``): the normalized batch and the new
    running statistics equal eager's, with the check against eager off, so that nothing but
    the translation is under test."""
    aten = torch.ops.aten

    class Norm(torch.nn.Module):
        def forward(self, x, w, b, mean, var):
            return tuple(aten._native_batch_norm_legit_functional.default(x, w, b, mean, var, True, 0.1, 1e-5))
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(8, 4, 6, 6, generator=g) * 3 + 1, torch.randn(4, generator=g), torch.randn(4, generator=g),
            torch.zeros(4), torch.ones(4))
    c = kiln.trace(Norm(), args, engine="onnxruntime", optlevel=1, validate=False, cache=False)
    assert [p["engine"] for p in c.manifest["partitions"]] == ["onnxruntime"]
    torch.testing.assert_close(c(*args), Norm()(*args), rtol=1e-5, atol=1e-5)
    evaluation = aten._native_batch_norm_legit_no_training.default(*args, 0.1, 1e-5)[0]
    assert (c(*args)[0] - evaluation).abs().max() > 1.0      # not evaluation mode's answer



def test_an_accumulating_index_write_on_onnx_runtime_checks_its_indices():
    """The one-hot product an accumulating ``index_put`` is summed as on ONNX Runtime takes a
    negative index from the end, as eager does, and raises on one out of range, as eager does:
    compared with ``arange`` alone, an index of 7 among 4 rows made a row of zeros and its
    update was silently lost."""
    from kiln.engines import onnxruntime as ort_engine

    class Accumulate(torch.nn.Module):
        def forward(self, src, idx):
            return torch.zeros(4, 3).index_put((idx,), src * 2, accumulate=True)
    src = torch.randn(3, 3)
    c = kiln.trace(Accumulate(), (src, torch.tensor([0, 3, 3])), engine="onnxruntime", optlevel=1, cache=False)
    graph = ort_engine.graph_of(c._artifact.blobs[c.manifest["partitions"][0]["blob"]])
    assert "ScatterND" not in {n.op_type for n in graph.graph.node}     # the one-hot product
    for idx in ([1, -1, -4], [2, 2, -2]):
        torch.testing.assert_close(c(src, torch.tensor(idx)), Accumulate()(src, torch.tensor(idx)))
    for idx in ([1, 7, 0], [0, -5, 1]):
        with pytest.raises(IndexError):
            Accumulate()(src, torch.tensor(idx))                     # eager's answer
        with pytest.raises(Exception, match="out of"):
            c(src, torch.tensor(idx))

@pytest.mark.parametrize("rows", [4, 64])
def test_accumulating_index_writes_never_race_on_onnx_runtime(rows):
    """ONNX Runtime's ScatterND with ``reduction="add"`` (torch's export of an accumulating
    ``index_put``, ``index_add`` and the embedding gradient) races between threads on repeated
    indices: with two threads, 39 to 121 of 200 calls summed wrongly here. A small one is summed
    as a one-hot product on ONNX Runtime instead (4 rows: 4M multiply-adds), a large one runs on
    the host with eager's kernels (64 rows); either way 200 calls at two engine threads all equal
    eager's to 1e-5. An exported graph that still holds such a ScatterND is refused at build."""
    from kiln.engines import onnxruntime as ort_engine

    class Accumulate(torch.nn.Module):
        def forward(self, src, idx, base):
            return torch.zeros(rows, 512).index_add(0, idx, src * 2) + base.index_put((idx,), src, accumulate=True)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2048, 512, generator=g) * 0.01, torch.randint(0, rows, (2048,), generator=g),
            torch.zeros(rows, 512))
    with _whole_program_decompositions() as passes:
        c = kiln.trace(Accumulate(), args, engine="onnxruntime", optlevel=1, cache=False, threads=2)
    host = {u["op"]: u for u in c.report["unsupported_ops"]}     # index_add kept whole (its index check)
    if rows == 4:
        assert passes == []          # the one-hot products written where the writes stood
        assert not host and [p["engine"] for p in c.manifest["partitions"]] == ["onnxruntime"], host
        graph = ort_engine.graph_of(c._artifact.blobs[c.manifest["partitions"][0]["blob"]])
        assert "ScatterND" not in {n.op_type for n in graph.graph.node}
    else:
        assert all(host[op]["count"] == 1 and "race" in host[op]["reason"] for op in ("aten::index_put", "aten::index_add")), host
    expected = Accumulate()(*args)
    # index_add is summed as index_put's accumulation: eager's rounding, not its bits; a race
    # loses whole terms (about 0.01 each)
    worst = max((c(*args) - expected).abs().max().item() for _ in range(200))
    assert worst < 1e-5, worst

    import onnx
    from onnx import TensorProto, helper
    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction="add")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4]),
                                            helper.make_tensor_value_info("indices", TensorProto.INT64, [3, 1]),
                                            helper.make_tensor_value_info("updates", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph)
    onnx.checker.check_model(model)                  # a valid model: refused for the ScatterND alone
    with pytest.raises(RuntimeError, match="race"):
        ort_engine._fuse_decoder(model.SerializeToString())


def test_onnx_runtime_never_gets_bfloat16_operations():
    """ONNX Runtime's CPU build has no bf16 Add, Mul, MatMul or reductions: a bf16 graph's
    build used to fail at session creation, after its export (1.7-15 s a training graph).
    Its support check now refuses bf16 operations up front, with the reason, and a bf16
    model is built by another engine without an ONNX Runtime attempt."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from kiln import engines
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    gm = make_fx(lambda t: (t @ t.t() + 1).float(), tracing_mode="fake")(x)
    verdict = {str(n.target): engines.get("onnxruntime").supports(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert "bfloat16" in verdict["aten.mm.default"] and "bfloat16" in verdict["aten.add.Tensor"], verdict
    # its output is float32, but a partition holding it would take a bf16 input, which
    # ONNX Runtime's binding cannot take either
    assert "bfloat16" in verdict["aten._to_copy.default"], verdict

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).to(torch.bfloat16).eval()
    c = kiln.trace(model, x, optlevel=1, whole_graph=True, cache=False)
    tried = [a["engine"] for p in c.manifest["partitions"] for a in p["candidates"]]
    assert "onnxruntime" not in tried, tried
    torch.testing.assert_close(c(x), model(x), rtol=1.6e-2, atol=1.6e-2)


def test_a_cast_from_bfloat16_runs_on_the_host_and_the_float32_rest_on_onnx_runtime(monkeypatch):
    """A graph that casts a bf16 input to float32 and computes in float32 (an autocast
    step's master weights and losses): the cast used to join the ONNX Runtime partition,
    whose bf16 input ONNX Runtime then could not take, so the partition fell through
    OpenVINO to an Inductor C++ build (four of them, 36 s, for the device's bf16 MLP step,
    where ONNX Runtime builds the float32 parts in a fraction of a second)."""

    class CastThenLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x.float()) + 1).sum(-1)

    from kiln.host import target
    # a CPU that emulates bf16: where it is native, the graph goes whole to Inductor instead
    # (test_a_bf16_model_goes_whole_to_inductor_where_the_cpu_computes_bf16)
    monkeypatch.setattr(target, "native", lambda kind: False)
    torch.manual_seed(0)
    model, x = CastThenLinear().eval(), torch.randn(4, 8, dtype=torch.bfloat16)
    c = kiln.trace(model, x, optlevel=1, cache=False)
    (part,) = c.manifest["partitions"]
    assert part["engine"] == "onnxruntime" and [i["dtype"] for i in part["inputs"]] == ["float32"], part
    assert [a["status"] for a in part["candidates"]] == ["ok"], part["candidates"]
    torch.testing.assert_close(c(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_host_op_raises_eagers_own_error_for_values_eager_rejects():
    """A host operation runs eager's kernel, so its error for the values it is given (an
    integer division by zero) is eager's, of its type and in its words; it was a KilnError
    saying the artifact's program was broken."""
    class Divide(torch.nn.Module):
        def forward(self, a, b):
            return torch.div(a, b, rounding_mode="floor") + 1

    a, b = torch.tensor([7, -7, 9]), torch.tensor([2, 3, 4])
    c = kiln.trace(Divide(), (a, b), engine="openvino", optlevel=1, cache=False, quiet=True)
    assert not c.manifest["partitions"]          # OpenVINO takes no integer floor division: the host's
    assert c(a, b).tolist() == Divide()(a, b).tolist()
    with pytest.raises(RuntimeError, match="ZeroDivisionError") as eager:
        Divide()(a, torch.tensor([2, 0, 4]))
    with pytest.raises(type(eager.value), match="ZeroDivisionError") as got:
        c(a, torch.tensor([2, 0, 4]))
    assert any("host operation" in note for note in getattr(got.value, "__notes__", []))


def test_integer_division_by_a_tensor_runs_on_the_host_where_zero_raises():
    """An integer division or remainder by a tensor runs on eager's kernel: for a zero divisor
    ONNX Runtime answered -9223372036854775807 (7 // 0) and an AOTInductor build ended the
    process (SIGFPE), where eager raises ZeroDivisionError. Every engine but eager's own
    declines it (checked here without building each); float division stays compiled."""
    from kiln import engines
    from kiln.graph import zero_divisors
    from kiln.graph.capture import capture
    from kiln.graph.partition import takes

    class Divide(torch.nn.Module):
        def forward(self, a, b, x):
            return (a // b + torch.remainder(a, b) + torch.fmod(a, b)) * 2 + a // 3, x / b

    a, b, x = torch.tensor([7, -7, 9]), torch.tensor([2, 3, 4]), torch.tensor([1.0, 2.0, 3.0])
    graph = capture(Divide(), (a, b, x)).graph_module
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    dividing = [n for n in nodes if zero_divisors.by_a_tensor(n)]
    assert len(dividing) == 3                       # a // 3 divides by a number; x / b is a float division
    for name in ("onnxruntime", "openvino", "inductor"):
        engine = engines.get(name, purpose="compile")
        assert all(takes(engine, n) == zero_divisors.WHY_HOST for n in dividing), name
    assert all(takes(engines.get("eager", purpose="compile"), n) is None for n in dividing)

    c = kiln.trace(Divide(), (a, b, x), engine="onnxruntime", optlevel=1, cache=False, quiet=True)
    assert {u["op"] for u in c.report["unsupported_ops"]} >= {"aten::div.Tensor_mode", "aten::remainder.Tensor"}
    for got, want in zip(c(a, b, x), Divide()(a, b, x)):
        assert torch.equal(got, want)
    zero = torch.tensor([2, 0, 4])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        Divide()(a, zero, x)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        c(a, zero, x)


def test_python_arithmetic_on_a_data_dependent_size_is_a_clear_error():
    """float() of torch.nonzero(...).shape[0] leaves a Python step (sym_float) among the host
    steps, which a program cannot store: it was 'host op <function sym_float ...> is not a
    torch operator and cannot be stored', without the model's line or what to change."""
    class SizeTimesSum(torch.nn.Module):
        def forward(self, x):
            return x.sum() * (torch.nonzero(x > 0).shape[0] * 1.0)

    with pytest.raises(kiln.KilnError, match=r"depends on the data in Python \(sym_float at .*test_fallback.py.*"
                                             r"nonzero.*Compute it as a tensor"):
        kiln.trace(SizeTimesSum(), torch.randn(3, 4), cache=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_division_by_a_number_is_exact_on_onnx_runtime(dtype):
    """Integer floor and trunc division by a number stay integer on ONNX Runtime: the exporter
    wrote them Cast(float32) → Div → Floor → Cast, so a quotient past 2^24 came out rounded
    (16,777,217,000 // 1000 gave 16777218, an int32 2,147,483,643 // 3 gave 715827904) while the
    check on small example values passed. Negative operands round as eager's do."""
    class Bucketize(torch.nn.Module):
        def forward(self, a):
            return (a // 1000, a // -7, torch.div(a, 7, rounding_mode="trunc"), torch.div(a, -3, rounding_mode="trunc"),
                    torch.floor_divide(a, 3), a % 1000, torch.remainder(a, -7), torch.fmod(a, 7), torch.fmod(a, -7))

    big = [16_777_217_000, -16_777_217_000, 2**53 + 1, -(2**53) - 3, 2**62 + 7] if dtype == torch.int64 else \
        [2_147_483_643, -2_147_483_643, 16_777_217, -16_777_217, 2**31 - 1]
    x = torch.tensor([*big, 987_654_321, -987_654_321, 5, -5, 0], dtype=dtype)
    c = kiln.trace(Bucketize(), torch.randint(-10_000, 10_000, (10,), dtype=dtype), engine="onnxruntime",
                   optlevel=1, cache=False, quiet=True)
    assert [p["engine"] for p in c.manifest["partitions"]] == ["onnxruntime"]
    for i, (got, want) in enumerate(zip(c(x), Bucketize()(x))):
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), (i, got.tolist(), want.tolist())
