"""Runtime metrics and profiler timelines."""
import json

import torch

import kiln

from . import models


def _entry(model):
    return next(m for m in kiln.metrics()["models"] if m["id"] == model.metrics.id)


def test_metrics_count_calls_latency_and_bytes():
    model, x = models.mlp()
    compiled = kiln.trace(model, x)
    for _ in range(5):
        compiled(x)
    m = _entry(compiled)
    assert m["calls_completed"] == 6           # 5 + the validation run at compile time
    assert m["calls_failed"] == 0
    assert m["bytes_in"] == 6 * 2 * 16 * 4 and m["bytes_out"] == 6 * 2 * 4 * 4
    assert 0 < m["latency_ms"]["p50"] <= m["latency_ms"]["p99"] <= m["latency_ms"]["max"] * 1.26
    assert m["host_seconds"] == 0 and m["device_seconds"] > 0
    assert "compile_cache" in kiln.metrics()
    report = kiln.metrics_report()
    assert "Model MLP" in report and "Calls: completed=6 failed=0" in report


def test_metrics_split_device_and_host_fallback_time():
    model, x = models.custom_op()
    compiled = kiln.trace(model, x)
    compiled(x)
    m = _entry(compiled)
    assert m["host_seconds"] > 0 and m["device_seconds"] > 0 and 0 < m["host_share"] < 1


def test_bucket_hits_are_counted():
    model, _ = models.mlp()
    compiled = kiln.trace(model, buckets=[torch.randn(1, 16), torch.randn(4, 16)])
    for n in (1, 2, 3, 4):
        compiled(torch.randn(n, 16))
    assert _entry(compiled)["bucket_hits"] == {"1": 1, "4": 3}


def test_profile_writes_chrome_trace_with_host_fallback_spans(tmp_path):
    model, x = models.custom_op()
    compiled = kiln.trace(model, x)
    path = tmp_path / "trace.json"
    with kiln.profile(path):
        compiled(x)
        compiled(x)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    calls = [e for e in events if e["cat"] == "call"]
    device = [e for e in events if e["cat"] == "device"]
    host = [e for e in events if e["cat"] == "host"]
    assert len(calls) == 2 and len(device) >= 2 and len(host) >= 2
    assert all(e["args"]["host_fallback"] for e in host)
    assert not any(e["args"]["host_fallback"] for e in device)
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    call = calls[0]
    inside = [e for e in device + host if call["ts"] <= e["ts"] <= call["ts"] + call["dur"]]
    assert inside, "partition spans lie inside their call's span"
    compiled(x)                                    # profiling off again: nothing more recorded
    assert len(json.loads(path.read_text())["traceEvents"]) == len(events)


def test_kiln_spans_appear_in_torch_profiler():
    model, x = models.custom_op()
    compiled = kiln.trace(model, x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("kiln::WithCustomOp::partition") for n in names), sorted(names)[:20]
    assert any(n.startswith("kiln::WithCustomOp::host") for n in names)


def test_kiln_ls_lists_cores_isa_and_engines(kiln_cli):
    import os
    import subprocess
    from kiln.host import cores as placement
    r = subprocess.run([kiln_cli, "ls", "--json"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KILN_CPUS_PER_CORE": "1"})
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert [c["cpus"] for c in info["cores"]] == [[c] for c in placement.process_cpus()]
    assert info["engines"]["onnxruntime"] and info["memory_total_bytes"] > 0
    r = subprocess.run([kiln_cli, "ls"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KILN_VISIBLE_CORES": "0", "KILN_CPUS_PER_CORE": "1"})
    assert "1 kiln cores" in r.stdout and "onnxruntime" in r.stdout


def test_nothing_starts_at_import_or_when_counters_are_built(tmp_path):
    """The heartbeat, its registry file and KILN_PROFILE start when a model is loaded, not before."""
    from .conftest import run_py
    (tmp_path / "run").mkdir()
    r = run_py("""
import os, threading, torch, kiln
from kiln.observe import profiler
from kiln.observe.metrics import ModelMetrics
ModelMetrics("counters only")
print(sorted(t.name for t in threading.enumerate()), os.listdir(os.environ["KILN_RUN_DIR"]),
      profiler.active() is None)
m = kiln.trace(torch.nn.Linear(4, 2), torch.randn(1, 4), quiet=True)
print("kiln-heartbeat" in [t.name for t in threading.enumerate()], profiler.active() is not None)
""", env={"KILN_RUN_DIR": str(tmp_path / "run"), "KILN_PROFILE": str(tmp_path / "trace.json")})
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    assert first == "['MainThread'] [] True"
    assert second == "True True"
    assert (tmp_path / "trace.json").exists()
