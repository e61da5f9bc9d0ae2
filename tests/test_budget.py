"""Eager as a measured candidate (-O2 and -O3) and the compile budget (--compile-budget)."""
import time

import pytest

import kiln
from kiln import engines
from kiln.compiler import measure
from kiln.compiler.driver import make_options
from kiln.compiler.options import DEFAULT_BUDGET, budget_seconds, parse_compiler_args
from tests import models
from tests.conftest import assert_close


class Slowpoke(engines.Engine):
    """Runs the partition in PyTorch after sleeping 20 ms: eager is always far faster."""
    name = "slowpoke"
    priority = {"cpu": 1}
    package = "torch"
    modules = ("torch",)
    built: dict = {}

    def supports(self, node):
        return None

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        key = str(len(self.built)).encode()
        self.built[key] = partition
        return key

    def load(self, blob, runtime_options, origin=None):
        sub = self.built[bytes(blob)]

        def run(inputs):
            time.sleep(0.02)
            out = sub(*inputs)
            return list(out) if isinstance(out, (list, tuple)) else [out]
        return run


class Glacial(engines.Engine):
    """Says its builds take 1000 s: any budget skips it after the first good build."""
    name = "glacial"
    priority = {"cpu": 40}
    package = "torch"
    modules = ("torch",)
    build_seconds = 1000.0

    def supports(self, node):
        return None

    def compile(self, *a, **k):
        raise RuntimeError("the budget should have skipped this build")


def test_eager_is_kept_where_it_is_faster_with_a_note():
    model, x = models.mlp()
    with engines.registered(Slowpoke, without=("onnxruntime", "openvino", "inductor")):
        compiled = kiln.trace(model, x, cache=False)
    (part,) = compiled.manifest["partitions"]
    assert part["engine"] == "eager"
    assert part["note"].startswith("partition 1/1 runs eagerly: slowpoke ")
    assert "PyTorch eager is faster" in part["choice"]
    slow = next(c for c in part["candidates"] if c["engine"] == "slowpoke")
    assert slow["status"] == "ok" and slow["latency_ms"] > part["eager_latency_ms"]
    assert part["latency_ms"] == part["eager_latency_ms"] and part["speed_vs_eager"] == 1.0
    assert measure.notes(compiled.manifest["partitions"])[0] == part["note"]
    assert_close(compiled(x), model(x).detach())


def test_o3_keeps_eager_too_and_o1_never_times():
    model, x = models.mlp()
    with engines.registered(Slowpoke, without=("onnxruntime", "openvino", "inductor")):
        (o3,) = kiln.trace(model, x, optlevel=3, cache=False).manifest["partitions"]
        (o1,) = kiln.trace(model, x, optlevel=1, cache=False).manifest["partitions"]
    assert o3["engine"] == "eager" and "runs eagerly" in o3["note"]
    assert o1["engine"] == "slowpoke" and "eager_latency_ms" not in o1 and "note" not in o1


def test_a_named_engine_is_kept_and_its_speed_against_eager_recorded():
    model, x = models.mlp()
    with engines.registered(Slowpoke):
        compiled = kiln.trace(model, x, engine="slowpoke", cache=False)
    (part,) = compiled.manifest["partitions"]
    assert part["engine"] == "slowpoke" and part["choice"] == "engine chosen by the user"
    assert part["eager_latency_ms"] > 0 and part["latency_ms"] > 0 and "note" not in part
    assert part["speed_vs_eager"] == pytest.approx(part["eager_latency_ms"] / part["latency_ms"], rel=1e-2)


class Picky(Slowpoke):
    """Takes every operation but ReLU, fast: whole_graph then sends the graph elsewhere."""
    name = "picky"

    def supports(self, node):
        return "not ReLU" if "relu" in str(node.target) else None


class SlowWhole(Slowpoke):
    """Stands in for Inductor (whole_graph's engine): takes everything, slowly."""
    name = "inductor"
    priority = {"cpu": 30}


def test_the_whole_graph_engine_is_still_held_to_eagers_speed():
    """whole_graph names Inductor for the graph, but the user did not: at -O2 it is timed
    against eager like any engine, and eager kept where it is faster (it used to count as
    the user's choice, kept however slow)."""
    model, x = models.mlp()
    with engines.registered(Picky, SlowWhole, without=("onnxruntime", "openvino")):
        compiled = kiln.trace(model, x, whole_graph=True, cache=False)
    (part,) = compiled.manifest["partitions"]
    assert any("whole_graph" in n for n in compiled.manifest["report"]["notes"])
    assert part["engine"] == "eager" and part["note"].startswith("partition 1/1 runs eagerly: inductor ")
    with engines.registered(Picky, SlowWhole, without=("onnxruntime", "openvino")):
        (o1,) = kiln.trace(model, x, whole_graph=True, optlevel=1, cache=False).manifest["partitions"]
    assert o1["engine"] == "inductor" and "whole_graph" in o1["choice"] and "user" not in o1["choice"]
    assert_close(compiled(x), model(x).detach())


def test_quantized_partitions_are_never_compared_with_eager():
    model, x = models.mlp()
    compiled = kiln.trace(model, x, quantize="int8", min_cosine=0.9, min_top1=0.0, cache=False)
    (part,) = compiled.manifest["partitions"]
    assert part["engine"] != "eager" and "eager_latency_ms" not in part
    assert all(c["engine"] != "eager" for c in part["candidates"])


def test_the_budget_skips_candidates_it_cannot_afford_and_says_why():
    model, x = models.mlp()
    with engines.registered(Glacial, without=("openvino", "inductor")):
        compiled = kiln.trace(model, x, compiler_args="-O3 --compile-budget 120", cache=False)
    (part,) = compiled.manifest["partitions"]
    skipped = next(c for c in part["candidates"] if c["engine"] == "glacial")
    assert skipped["status"] == "skipped"
    assert skipped["note"].startswith("skipped: budget, ") and "glacial needs ~1000.0 s" in skipped["note"]
    assert part["engine"] in ("onnxruntime", "eager")
    assert_close(compiled(x), model(x).detach())


def test_the_first_good_build_is_made_whatever_the_budget():
    model, x = models.mlp()
    with engines.registered(Glacial, without=("onnxruntime", "openvino", "inductor")):
        with pytest.raises(kiln.CompileError, match="should have skipped"):
            kiln.trace(model, x, compiler_args="-O3 --compile-budget 0.001", engine="glacial",
                       cache=False)


class _Progress:
    label = "kiln"

    def __init__(self, spent):
        self.timings = {"capture": spent}


def test_budget_counts_the_graphs_phases_and_prefers_measured_build_times():
    budget = measure.Budget(make_options(compile_budget=5.0), _Progress(spent=4.5))
    assert 0 < budget.left() <= 0.5
    glacial = Glacial()
    assert budget.refusal(glacial, "glacial").startswith("skipped: budget, 0.")
    budget.built(glacial, 0.0001)                   # its own build here was quick after all
    assert budget.expected(glacial) == 0.0001 and budget.refusal(glacial, "glacial") is None
    with budget.shown():
        assert budget.progress.label.startswith("kiln [budget ")
    assert budget.progress.label == "kiln"


def test_expected_build_times_scale_with_the_partition():
    class Native(engines.Engine):
        name, native_code = "budget-scaling-native", True
    small = measure.Budget(make_options(compile_budget=60.0), _Progress(spent=0.0), ops=10)
    big = measure.Budget(make_options(compile_budget=60.0), _Progress(spent=0.0), ops=1000)
    assert small.expected(Native()) == measure.NATIVE_SECONDS            # the floor
    assert big.expected(Native()) == pytest.approx(measure.NATIVE_PER_OP * 1000)
    small.built(Native(), 2.0)                     # 0.2 s per op, remembered in this process
    assert big.expected(Native()) == pytest.approx(200.0)
    assert big.refusal(Native(), "native").startswith("skipped: budget")


@pytest.mark.parametrize("flags, seconds", [("--compile-budget 5", 5.0), ("--compile-budget=0.5", 0.5),
                                            (["-O3", "--compile-budget", "90"], 90.0)])
def test_compile_budget_flag_parses(flags, seconds):
    assert parse_compiler_args(flags)["compile_budget"] == seconds
    assert budget_seconds(make_options(flags)) == seconds


@pytest.mark.parametrize("flags", ["--compile-budget 0", "--compile-budget -1", "--compile-budget abc",
                                   "--compile-budget nan", "--compile-budget inf", "--compile-budget"])
def test_compile_budget_flag_rejects_bad_values(flags):
    with pytest.raises(kiln.CompilerArgsError, match="--compile-budget"):
        parse_compiler_args(flags)


def test_final_timing_shrinks_to_the_budget_left_but_never_to_nothing():
    full = measure.final_timing(60.0, 4)
    assert full == {"seconds": measure.FINAL_SECONDS, "warmup": measure.FINAL_WARMUP}
    assert measure.final_timing(8.0, 4) == {"seconds": 1.0, "warmup": 1}     # half of what is left
    assert measure.final_timing(-5.0, 4) == {"seconds": measure.FINAL_FLOOR, "warmup": 1}


def test_compile_budget_keyword_and_defaults():
    with pytest.raises(kiln.CompilerArgsError, match="compile_budget"):
        make_options(compile_budget=-2)
    assert budget_seconds(make_options()) == DEFAULT_BUDGET[2]
    assert budget_seconds(make_options("-O3")) == DEFAULT_BUDGET[3] == 60.0
    assert budget_seconds(make_options("-O3", compile_budget=7)) == 7.0


def test_summary_of_the_models_speed_against_eager():
    parts = [{"id": 0, "engine": "onnxruntime", "latency_ms": 1.0, "eager_latency_ms": 3.0},
             {"id": 1, "engine": "eager", "latency_ms": 0.5, "eager_latency_ms": 0.5,
              "note": "partition 2/2 runs eagerly: onnxruntime 0.9 ms vs eager 0.5 ms"}]
    total = measure.summarize(parts)
    assert total["speed_vs_eager"] == round(3.5 / 1.5, 3) and total["eager_partitions"] == [1]
    lines = measure.notes(parts)
    assert lines[0] == parts[1]["note"] and lines[1].startswith("speed vs eager: 2.33x")
    assert measure.summarize([parts[0], {"id": 2, "engine": "onnxruntime"}]) is None
