"""Pipelines: one model split into stages on two kiln cores, requests streamed through."""
import io
import threading

import pytest
import torch
from torch import nn

import kiln
from kiln.host import cores as placement
from kiln.compiler.options import parse_compiler_args
from kiln.compiler.stages import partition
from kiln.runtime.stages import Pipeline
from tests import models
from tests.conftest import assert_close, run_py

WAIT = 60   # seconds; only bounds a hang, never asserts speed


def deep_mlp():
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(16, 16), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(16, 4)).eval()


@pytest.fixture(scope="module")
def two_cores():
    """One kiln core per CPU, so a 2-CPU machine has the two cores a 2-stage pipeline needs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CPUS_PER_CORE", "1")
        mp.delenv("KILN_NUM_CORES", raising=False)
        mp.delenv("KILN_VISIBLE_CORES", raising=False)
        if len(placement.visible()) < 2:
            pytest.skip("needs at least 2 CPUs")
        yield


@pytest.fixture(scope="module")
def mlp_case(two_cores):
    model = deep_mlp()
    x = torch.randn(3, 16)
    pipe = kiln.trace(model, x, pipeline_cores=2)
    yield model, x, pipe
    pipe.close()


def inputs(n):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(3, 16, generator=g) for _ in range(n)]


def expected(model, x):
    with torch.no_grad():
        return model(x)


# -- compile -----------------------------------------------------------------------------
def test_mlp_pipeline_matches_eager_and_unsplit(mlp_case):
    model, x, pipe = mlp_case
    assert isinstance(pipe, Pipeline) and len(pipe.stages) == 2
    assert_close(pipe(x), expected(model, x))
    unsplit = kiln.trace(model, x)
    for xi in inputs(3):
        assert_close(pipe(xi), unsplit(xi), atol=1e-5, rtol=1e-5)
    m = pipe.manifest
    assert m["kind"] == "pipeline" and m["validation"]["passed"]
    stages = m["pipeline"]["stages"]
    assert sum(s["cost_share"] for s in stages) == pytest.approx(1.0, abs=1e-3)
    assert all(s["nodes"] > 0 and s["compile_seconds"] > 0 for s in stages)
    assert stages[0]["inputs"] == [["input", 0]]
    assert "2 stages on cores 0, 1" in repr(pipe)


def test_stages_are_pinned_to_different_cores(mlp_case):
    _, _, pipe = mlp_case
    cores = placement.visible()
    for k, stage in enumerate(pipe.stages):
        assert stage.core.id == k
        assert stage.worker.affinity() == set(cores[k].cpus)
    assert pipe.stages[0].worker is not pipe.stages[1].worker


def test_compiler_args_pipeline_cores(two_cores):
    assert parse_compiler_args(["--neuroncore-pipeline-cores", "4"]) == {"pipeline_cores": 4}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    pipe = kiln.trace(model, x, compiler_args=["--neuroncore-pipeline-cores", "2"])
    assert isinstance(pipe, Pipeline) and len(pipe.stages) == 2
    assert_close(pipe(x), expected(model, x))
    pipe.close()


def test_more_stages_than_cores_is_a_clear_error(two_cores, monkeypatch):
    monkeypatch.setenv("KILN_NUM_CORES", "2")
    with pytest.raises(kiln.PlacementError, match=r"3 stages.*sees 2"):
        kiln.trace(deep_mlp(), torch.randn(3, 16), pipeline_cores=3)


def test_graph_smaller_than_pipeline_is_a_clear_error(two_cores):
    class One(nn.Module):
        def forward(self, x):
            return torch.relu(x)

    with pytest.raises(kiln.CompilerArgsError, match="too few to split over 2 pipeline cores"):
        kiln.trace(One(), torch.randn(2, 3), pipeline_cores=2)


# -- streaming -------------------------------------------------------------------------------
def test_submit_resolves_in_order(mlp_case):
    model, _, pipe = mlp_case
    xs = inputs(8)
    before = pipe.calls
    futures = [pipe.submit(x) for x in xs]
    for f, x in zip(futures, xs):
        assert_close(f.result(timeout=WAIT), expected(model, x))
    assert pipe.calls == before + 8


def test_map_streams(mlp_case):
    model, _, pipe = mlp_case
    xs = inputs(6)
    outs = list(pipe.map(xs, max_in_flight=3))
    assert len(outs) == 6
    for out, x in zip(outs, xs):
        assert_close(out, expected(model, x))


def test_stages_work_on_different_requests_at_once(mlp_case, monkeypatch):
    """Stage 2 holds request 0 until stage 1 has started request 1: only a pipeline
    that streams gets there; one that serialises requests would wait forever."""
    model, _, pipe = mlp_case
    first, second = pipe.stages
    second_started = threading.Event()
    seen = []
    run0, run1 = first.run_flat, second.run_flat

    def stage0(flat):
        seen.append("s0")
        if seen.count("s0") == 2:
            second_started.set()
        return run0(flat)

    def stage1(flat):
        if "s1" not in seen:
            seen.append(("overlap", second_started.wait(WAIT)))
        seen.append("s1")
        return run1(flat)

    monkeypatch.setattr(first, "run_flat", stage0)
    monkeypatch.setattr(second, "run_flat", stage1)
    xs = inputs(3)
    futures = [pipe.submit(x) for x in xs]
    for f, x in zip(futures, xs):
        assert_close(f.result(timeout=WAIT), expected(model, x))
    assert ("overlap", True) in seen


def test_a_failing_request_fails_alone_and_in_order(mlp_case, monkeypatch):
    model, _, pipe = mlp_case
    first, second = pipe.stages
    third_started = threading.Event()
    snapshot = []
    futures = []
    count = [0]
    run0, run1 = first.run_flat, second.run_flat

    def stage0(flat):
        count[0] += 1
        if count[0] == 3:
            third_started.set()
        if flat[0][0, 0].item() == 1234.0:
            raise RuntimeError("boom in stage 1")
        return run0(flat)

    def stage1(flat):
        if not snapshot:
            # request 1 failed in stage 1 before stage 1 took request 2; request 0 is
            # still here in stage 2, so request 1's future must not have resolved yet
            snapshot.append((third_started.wait(WAIT), futures[1].done()))
        return run1(flat)

    monkeypatch.setattr(first, "run_flat", stage0)
    monkeypatch.setattr(second, "run_flat", stage1)
    xs = inputs(4)
    xs[1] = xs[1].clone()
    xs[1][0, 0] = 1234.0
    for x in xs:
        futures.append(pipe.submit(x))
    with pytest.raises(RuntimeError, match="boom"):
        futures[1].result(timeout=WAIT)
    for i in (0, 2, 3):
        assert_close(futures[i].result(timeout=WAIT), expected(model, xs[i]))
    assert snapshot == [(True, False)]
    monkeypatch.undo()
    assert_close(pipe(xs[0]), expected(model, xs[0]))


def test_bad_inputs_fail_like_a_compiled_model(mlp_case):
    _, x, pipe = mlp_case
    with pytest.raises(kiln.InputError, match=r"input 'input': expected \(3, 16\) float32, got \(2, 16\)"):
        pipe(torch.randn(2, 16))
    fut = pipe.submit(x.double())
    with pytest.raises(kiln.InputError, match="float64"):
        fut.result(timeout=WAIT)


# -- persistence and placement ----------------------------------------------------------------
def test_save_and_load_in_a_fresh_process(mlp_case, tmp_path):
    model, x, pipe = mlp_case
    path = tmp_path / "mlp.kiln"
    pipe.save(str(path))
    torch.save(x, tmp_path / "x.pt")
    code = f"""
import os, torch, kiln
m = kiln.load({str(path)!r})   # kiln.runtime.stages not imported first: load must find the kind itself
assert type(m).__name__ == "Pipeline", type(m)
affinity = [sorted(s.worker.affinity()) for s in m.stages]
assert affinity[0] != affinity[1], affinity
x = torch.load({str(tmp_path / 'x.pt')!r})
futures = [m.submit(x) for _ in range(3)]
torch.save([f.result() for f in futures] + [m(x)], {str(tmp_path / 'out.pt')!r})
os.environ["KILN_NUM_CORES"] = "1"
try:
    kiln.load({str(path)!r})
except kiln.PlacementError as e:
    print("PLACEMENT:", e)
"""
    r = run_py(code, env={"KILN_CPUS_PER_CORE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PLACEMENT: cannot load a pipeline of 2 stages" in r.stdout
    outs = torch.load(tmp_path / "out.pt")
    for out in outs:
        assert torch.equal(out, pipe(x))


def test_load_from_bytes_and_to_core(mlp_case):
    model, x, pipe = mlp_case
    buf = io.BytesIO()
    pipe.save(buf)
    loaded = kiln.load(buf.getvalue())
    assert torch.equal(loaded(x), pipe(x))
    loaded.to_core(1)   # everything on one core: still correct, just not parallel
    core = placement.get(1)
    assert all(s.worker.affinity() == set(core.cpus) for s in loaded.stages)
    assert_close(loaded(x), expected(model, x))
    loaded.close()
    with pytest.raises(kiln.KilnError, match="closed"):
        loaded(x)


# -- partitioning -------------------------------------------------------------------------------
def test_partition_minimises_the_slowest_stage():
    costs = [4, 1, 1, 1, 1, 4]
    valid = [False] + [True] * 5 + [False]
    assert partition(costs, [0] * 7, valid, 2) == [0, 3, 6]
    assert partition(costs, [0] * 7, valid, 3) == [0, 1, 5, 6]
    # a cut that would pass a non-tensor is never taken
    assert partition(costs, [0] * 7, [False, True, True, False, True, True, False], 2) in ([0, 2, 6], [0, 4, 6])


def test_partition_breaks_ties_towards_fewer_crossing_tensors():
    costs = [1, 1, 0, 1, 1]
    valid = [False, True, True, True, True, False]
    assert partition(costs, [0, 1, 3, 1, 1, 0], valid, 2) == [0, 3, 5]
    assert partition(costs, [0, 1, 1, 3, 1, 0], valid, 2) == [0, 2, 5]


# -- a transformer ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_bert_pipeline_matches_eager_and_unsplit(two_cores):
    model = models.tiny_bert()
    ex = models.bert_inputs()
    pipe = kiln.trace(model, ex, pipeline_cores=2)
    unsplit = kiln.trace(model, ex)
    with torch.no_grad():
        ref = model(**ex)
    out = pipe(**ex)
    assert type(out) is type(ref)
    assert_close(out.last_hidden_state, ref.last_hidden_state)
    assert_close(out.pooler_output, ref.pooler_output)
    base = unsplit(**ex)
    assert_close(out.last_hidden_state, base.last_hidden_state, atol=1e-5, rtol=1e-5)
    shares = [s["cost_share"] for s in pipe.manifest["pipeline"]["stages"]]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3)
    futures = [pipe.submit(**ex) for _ in range(4)]
    for f in futures:
        assert_close(f.result(timeout=WAIT).pooler_output, ref.pooler_output)
    pipe.close()


def test_index_ranges_are_checked_as_the_first_stage_checks_them(two_cores):
    """Stages run unchecked: the pipeline itself must refuse a token id past the vocabulary,
    where eager raises IndexError (it answered, until the pipeline took its stages' ranges)."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(8, 8), nn.ReLU())]
    model = nn.Sequential(nn.Embedding(50, 8), *layers).eval()
    ids = torch.randint(0, 50, (2, 5))
    pipe = kiln.trace(model, ids, pipeline_cores=2)
    try:
        assert [r[:4] for r in pipe.index_ranges] == [(0, "input", 0, 50)]
        assert_close(pipe(ids), expected(model, ids))
        bad = ids.clone()
        bad[0, 3] = 50
        with pytest.raises(IndexError):
            expected(model, bad)
        with pytest.raises(kiln.IndexRangeError, match="input 'input' holds 50"):
            pipe(bad)
        with pytest.raises(kiln.IndexRangeError):
            pipe.submit(bad.fill_(10**6)).result(timeout=WAIT)
        loaded = kiln.load(pipe.to_bytes())
        with pytest.raises(kiln.IndexRangeError):
            loaded(bad)
        loaded.close()
    finally:
        pipe.close()
