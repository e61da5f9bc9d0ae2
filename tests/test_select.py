"""Engine choice: -O3 measurement, default rules, fallback to the next engine, missing engines."""
import time

import pytest
import torch

import kiln
from kiln import engines
from kiln.compiler import selection as select
from tests import models
from tests.conftest import assert_close


class NoSuchEngine(engines.Engine):
    """An engine whose package is not installed, in the CPU order after OpenVINO."""
    name = "nosuch"
    priority = {"cpu": 25}
    package = "kiln-nosuch-engine"
    modules = ("kiln.engines.nosuch_engine",)


@pytest.fixture
def fake_missing_engine():
    # CPU order: onnxruntime, openvino, nosuch (inductor left out: it compiles for seconds)
    with engines.registered(NoSuchEngine, without=("inductor",)):
        yield


def test_o3_keeps_the_engine_its_own_timings_say_is_fastest(fake_missing_engine):
    pytest.importorskip("openvino")
    model, x = models.cnn()
    compiled = kiln.trace(model, x, compiler_args="-O3")
    (part,) = compiled.manifest["partitions"]
    built = [c for c in part["candidates"] if c["status"] in ("ok", "dropped") and not c.get("variant")]
    assert {c["engine"] for c in built} == {"onnxruntime", "openvino"}
    timed = [c for c in part["candidates"] if c["status"] == "ok"]
    fastest = min(timed, key=lambda c: c["latency_ms"])
    assert part["engine"] == fastest["engine"]
    assert part["choice"] == "fastest measured latency (-O3)"
    for c in timed:
        assert c["compile_seconds"] > 0 and c["latency_ms"] > 0
    for c in part["candidates"]:
        if c["status"] == "dropped":           # its first calls were clearly slower than the best
            assert c["probe_ms"] > 0 and c["note"].startswith("dropped:")
    missing = next(c for c in part["candidates"] if c["engine"] == "nosuch")
    assert missing["status"] == "unavailable" and "cannot be imported" in missing["note"]
    assert_close(compiled(x), model(x).detach())


def test_o3_timing_is_not_skewed_by_the_previous_engines_threads():
    """An engine whose threads keep spinning after a call (ONNX Runtime, OpenMP) slows
    whichever engine runs next; strict call-by-call alternation would charge that to the
    other engine every time and pick the slower one."""
    last = []

    def runner(name, seconds):
        def run(inputs):
            spun = last and last[-1] == "spinner" and name != "spinner"
            time.sleep(seconds + (0.03 if spun else 0.0))
            last.append(name)
        return run

    ms = select.time_runners({"spinner": runner("spinner", 0.012), "quiet": runner("quiet", 0.003)}, [])
    assert ms["quiet"] < ms["spinner"]


def test_o1_uses_first_engine_without_timing_and_o2_times_it_against_eager():
    model, x = models.mlp()
    compiled = kiln.trace(model, x, optlevel=1)
    (part,) = compiled.manifest["partitions"]
    assert part["engine"] == "onnxruntime" and "latency_ms" not in part["candidates"][0]
    assert part["choice"].startswith("default engine") and "eager_latency_ms" not in part
    (part,) = kiln.trace(model, x).manifest["partitions"]            # -O2: timed against eager
    assert part["eager_latency_ms"] > 0 and part["latency_ms"] > 0
    assert part["speed_vs_eager"] == pytest.approx(part["eager_latency_ms"] / part["latency_ms"], rel=1e-2)
    if part["engine"] == "onnxruntime":
        assert part["choice"].startswith("default engine")
        eager = next(c for c in part["candidates"] if c["engine"] == "eager")
        assert eager["status"] == "timed" and eager["latency_ms"] == part["eager_latency_ms"]


def test_engine_that_fails_falls_through_to_the_next(monkeypatch):
    pytest.importorskip("openvino")
    ort = engines.get("onnxruntime")

    def broken(*a, **k):
        raise RuntimeError("simulated exporter failure")

    monkeypatch.setattr(ort, "compile", broken)
    model, x = models.mlp()
    compiled = kiln.trace(model, x, optlevel=1)     # -O2 would also time eager, which may win on a loaded machine
    (part,) = compiled.manifest["partitions"]
    assert part["engine"] == "openvino"
    assert "onnxruntime failed" in part["choice"]
    assert "simulated exporter failure" in part["candidates"][0]["note"]
    assert_close(compiled(x), model(x).detach())


def test_explicit_missing_engine_is_a_clear_error(fake_missing_engine):
    model, x = models.mlp()
    with pytest.raises(kiln.EngineUnavailableError, match="nosuch"):
        kiln.trace(model, x, engine="nosuch")


def test_quantize_never_falls_back_to_fp32_engines(monkeypatch):
    ort = engines.get("onnxruntime")
    monkeypatch.setattr(ort, "compile", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    model, x = models.mlp()
    with pytest.raises(kiln.CompileError, match="onnxruntime: RuntimeError: boom"):
        kiln.trace(model, x, quantize="int8")


def test_o3_times_each_engine_variant_and_records_which_it_kept(monkeypatch):
    """Variants are compiled and timed like engines at -O3 only; the manifest names the
    one kept, and the choice follows the recorded timings."""
    ort = engines.get("onnxruntime")
    real_compile, built = ort.compile, []

    def compile(sub, inputs, opts, variant=None, **kw):
        built.append(variant)
        return real_compile(sub, inputs, opts, **kw)

    monkeypatch.setattr(ort, "compile", compile)
    monkeypatch.setattr(ort, "variants", lambda opts: ("twin",))
    monkeypatch.setattr(select, "time_runners",
                        lambda runners, inputs, left=None: {"onnxruntime": 2.0, "onnxruntime:twin": 1.0})
    monkeypatch.setattr(select.measure, "DROP", float("inf"))     # no early drop on noise
    model, x = models.mlp()
    with engines.registered(without=("openvino", "inductor", "eager")):   # onnxruntime only
        compiled = kiln.trace(model, x, optlevel=3)
    (part,) = compiled.manifest["partitions"]
    assert built == [None, "twin"]
    assert [(c["engine"], c.get("variant"), c["latency_ms"]) for c in part["candidates"]] == [
        ("onnxruntime", None, 2.0), ("onnxruntime", "twin", 1.0)]
    assert part["engine"] == "onnxruntime" and part["variant"] == "twin"
    assert_close(compiled(x), model(x).detach())
    built.clear()
    kiln.trace(model, x)                       # -O2: the default build only
    assert built == [None]


def test_o2_compiles_attention_on_openvino_first_and_o1_keeps_the_plain_order():
    pytest.importorskip("openvino")
    bert, inputs = models.bert()
    compiled = kiln.trace(bert, inputs)
    engines = {(p["engine"], p["choice"]) for p in compiled.manifest["partitions"]}
    assert ("openvino", "default engine for attention partitions (-O2)") in engines
    out = compiled(**inputs)
    assert_close(out.last_hidden_state, bert(**inputs).last_hidden_state.detach(), atol=1e-3, rtol=1e-3)
    fast = kiln.trace(bert, inputs, optlevel=1)
    assert {p["engine"] for p in fast.manifest["partitions"]} == {"onnxruntime"}


@pytest.mark.parametrize("corrupt", ["offset", "nan", "dtype"])
def test_an_engine_that_answers_wrongly_loses_the_partition_to_the_next(monkeypatch, corrupt):
    """Each engine's build is run once on the partition's example inputs and compared with
    eager; a wrong answer (or NaN where eager has none, or the right values in another dtype:
    the next partition would read them as eager's) passes the partition on, with a note."""
    pytest.importorskip("openvino")
    ort = engines.get("onnxruntime")
    real_load = ort.load

    def load(blob, runtime_options, origin=None):
        run = real_load(blob, runtime_options, origin)
        bad = {"offset": lambda t: t + 0.5, "nan": lambda t: t.masked_fill(t > 0, float("nan")),
               "dtype": lambda t: t.to(torch.bfloat16)}[corrupt]
        return lambda inputs: [bad(t) for t in run(inputs)]

    monkeypatch.setattr(ort, "load", load)
    model, x = models.mlp()
    compiled = kiln.trace(model, x, optlevel=1)     # -O2 would also time eager, which may win under load
    (part,) = compiled.manifest["partitions"]
    first = part["candidates"][0]
    assert first["engine"] == "onnxruntime" and first["status"] == "inaccurate"
    assert {"offset": "max abs error 0.5", "nan": "NaN", "dtype": "dtype bfloat16, eager float32"}[corrupt] in first["note"]
    assert part["engine"] == "openvino" and "onnxruntime inaccurate" in part["choice"]
    assert_close(compiled(x), model(x).detach())


@pytest.mark.parametrize("answer", ["garbage", "lossy"])
def test_a_lossy_build_far_from_eager_loses_the_partition_but_a_merely_lossy_one_does_not(monkeypatch, answer):
    """Lossy compiles (int8 weights here) are held to the model's accuracy gate, not to eager's
    tolerances, partition by partition; but an output with a cosine similarity to eager's
    under checks.LOSSY_FLOOR is a broken build (an OpenVINO int4 prefill once answered at
    0.045), so the partition goes to the next engine instead of failing the gate."""
    pytest.importorskip("openvino")
    ort = engines.get("onnxruntime")
    real_load = ort.load
    noise = torch.Generator().manual_seed(0)

    def load(blob, runtime_options, origin=None):
        run = real_load(blob, runtime_options, origin)
        if answer == "garbage":         # the right scale, the wrong sign: cosine -1
            return lambda inputs: [-t for t in run(inputs)]
        return lambda inputs: [t + 0.01 * t.std() * torch.randn(t.shape, generator=noise) for t in run(inputs)]

    monkeypatch.setattr(ort, "load", load)
    model, x = models.mlp()
    compiled = kiln.trace(model, x, optlevel=1, quantize="int8", quantize_mode="weight_only",   # both engines quantize
                           min_cosine=0.99, min_top1=0.0, cache=False)
    (part,) = compiled.manifest["partitions"]
    first = part["candidates"][0]
    assert first["engine"] == "onnxruntime"
    if answer == "garbage":
        assert first["status"] == "inaccurate" and "cosine similarity" in first["note"]
        assert part["engine"] == "openvino" and "onnxruntime inaccurate" in part["choice"]
    else:
        assert first["status"] == "ok" and part["engine"] == "onnxruntime"
    with torch.no_grad():
        expected, actual = model(x), compiled(x)
    assert torch.nn.functional.cosine_similarity(expected.flatten(), actual.flatten(), dim=0) > 0.99


def test_a_build_in_the_wrong_dtype_is_never_kept_even_when_no_engine_agrees(monkeypatch):
    """An inaccurate build is kept when no engine matches eager (the validation gate then
    reports its numbers); one whose outputs have another dtype is not: whatever reads them
    next reads garbage (AOTInductor once returned a bf16 step's fp32 outputs as bf16)."""
    ort = engines.get("onnxruntime")
    real_load = ort.load

    def load(blob, runtime_options, origin=None):
        run = real_load(blob, runtime_options, origin)
        return lambda inputs: [t.to(torch.float64) for t in run(inputs)]

    monkeypatch.setattr(ort, "load", load)
    model, x = models.mlp()
    with engines.registered(without=("openvino", "inductor", "eager")), \
            pytest.raises(kiln.CompileError, match="dtype float64, eager float32"):
        kiln.trace(model, x, optlevel=1)


def test_the_compiled_model_keeps_the_session_its_check_opened(monkeypatch):
    """A compile loads the chosen build once, for its check, and the model it returns runs
    that session; a partition's engine is not opened a second time. Loading the artifact
    again (another process, a different option) opens it afresh."""
    e = engines.get("onnxruntime")
    loads = []
    original = type(e).load

    def counted(self, blob, runtime_options, origin=None):
        loads.append(runtime_options)
        return original(self, blob, runtime_options, origin)
    monkeypatch.setattr(type(e), "load", counted)
    model, x = models.mlp()
    compiled = kiln.trace(model, x, engine="onnxruntime", cache=False, quiet=True)
    assert len(compiled.manifest["partitions"]) == 1 and len(loads) == 1
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    again = kiln.load(compiled.to_bytes(), trust_native_code=True)
    assert len(loads) == 2
    assert_close(again(x), compiled(x))


def test_o3_keeps_an_engine_the_user_named():
    """``engine="onnxruntime"`` with -O3: its builds are timed against each other, the
    engines behind it are not built. Until 12-03 -O3 timed them too and could hand back an
    Inductor build (native code, which a later ``kiln.load`` must trust): found by probing."""
    model, x = models.mlp()
    compiled = kiln.trace(model, x, engine="onnxruntime", compiler_args="-O3", cache=False, quiet=True)
    for part in compiled.manifest["partitions"]:
        assert part["engine"] == "onnxruntime"
        built = {c["engine"] for c in part["candidates"] if c["status"] != "timed"}   # eager: timed, not built
        assert built == {"onnxruntime"}, part["candidates"]
    assert_close(compiled(x), model(x).detach())
