"""kiln bench: the JSON report, the plot, peers in the same run, artifacts through dynamic batch."""
import json
import os

import pytest
import torch

import kiln
from kiln.benchmark import peers
from tests.conftest import ROOT
from tests import forkserver

ROW_FIELDS = {"runner", "batch_size", "copies", "workers", "calls", "inferences", "duration_s", "throughput",
              "latency_ms", "setup_s", "cost_per_1m"}


def _check_row(row, duration):
    assert ROW_FIELDS <= set(row), row
    assert row["calls"] > 0 and row["inferences"] == row["calls"] * row["batch_size"]
    assert row["duration_s"] >= duration * 0.9
    assert row["throughput"] == pytest.approx(row["inferences"] / row["duration_s"], rel=0.01)
    lat = row["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    # each worker runs calls back to back: their summed latency fits in the window
    assert lat["mean"] * row["calls"] <= row["copies"] * row["workers"] * row["duration_s"] * 1e3 * 1.05


def test_bench_cli_compares_peers_and_writes_json_and_png(kiln_cli, tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = forkserver.run([kiln_cli, "bench", "tests.models:custom_op", "--duration", "0.4", "--warmup", "0.1",
                        "--copies", "1", "--workers", "1,2", "--compare", "eager", "--price-per-hour", "1.0",
                        "--json", str(out_json), "--plot", str(out_png)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["baseline"] == "eager" and report["skipped"] == []
    assert {"host", "config", "compile", "results", "kiln_version", "created"} <= set(report)
    assert report["compile"][0]["cache"] == "compiled" and "cache_key" in report["compile"][0]   # tests run cache-off
    rows = {(row["runner"], row["workers"]): row for row in report["results"]}
    assert set(rows) == {("kiln", 1), ("kiln", 2), ("eager", 1), ("eager", 2)}
    for row in rows.values():
        _check_row(row, 0.4)
        assert row["cost_per_1m"] == pytest.approx(1.0 / 3600 / row["throughput"] * 1e6, rel=0.01)
        base = rows[("eager", row["workers"])]["throughput"]
        assert row["throughput_vs_eager"] == pytest.approx(row["throughput"] / base, rel=0.01)
    # the custom op runs on the host: kiln's rows say so instead of hiding it
    assert rows[("kiln", 1)]["host_share"] > 0
    assert "on host fallback ops" in r.stdout and "eager" in r.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_bench_artifact_runs_other_batch_sizes_through_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    m = kiln.trace(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()), torch.randn(2, 16), quiet=True)
    path = str(tmp_path / "mlp.kiln")
    m.save(path)
    report = kiln.bench(path, batch_sizes=[3], copies=[2], workers=[1], duration=0.3, warmup=0.1,
                        compare=["eager"], quiet=True, json_path=str(tmp_path / "b.json"))
    (row,) = report["results"]
    _check_row(row, 0.3)
    assert row["runner"] == "kiln" and row["copies"] == 2 and row["batch_size"] == 3
    assert "dynamic batch" in row["note"]
    assert report["skipped"][0]["runner"] == "eager" and "factory" in report["skipped"][0]["reason"]
    assert json.loads((tmp_path / "b.json").read_text())["results"][0]["calls"] == row["calls"]


def test_bench_peer_errors(monkeypatch):
    with pytest.raises(kiln.KilnError, match="unknown peer 'tensorrt'"):
        kiln.bench("tests.models:mlp", compare=["tensorrt"], quiet=True)
    monkeypatch.setitem(peers._MODULE, "openvino", "kiln_no_such_engine")
    assert "not installed" in peers.unavailable("openvino")
    assert peers.unavailable("eager") is None and os.path.exists(os.path.join(ROOT, "tests", "models.py"))


class _Biased(torch.nn.Module):
    def forward(self, x, bias):
        return x + bias


def test_a_window_with_no_finished_call_and_an_input_every_row_shares(tmp_path, monkeypatch):
    """Found by probing: a window in which no call finished crashed the run formatting its
    p50 (None), and the benchmark resized every input's dim 0 to the batch, a shared bias
    too (of 8 it became one of 2: a crash, or at batch 1 another computation)."""
    from kiln.benchmark.inputs import factory_inputs
    monkeypatch.setattr("tests.test_bench.biased", lambda: (_Biased(), (torch.randn(4, 8), torch.randn(8))),
                        raising=False)
    _, args, _ = factory_inputs("tests.test_bench:biased", ROOT, 2)
    assert [tuple(a.shape) for a in args] == [(2, 8), (8,)]
    torch.manual_seed(0)
    m = kiln.trace(torch.nn.Linear(16, 8), torch.randn(2, 16), quiet=True)
    m.save(tmp_path / "m.kiln")
    report = kiln.bench(str(tmp_path / "m.kiln"), batch_sizes=[2], copies=[1], workers=[2], duration=1e-6, warmup=0,
                        quiet=True, plot_path=str(tmp_path / "b.png"))
    (row,) = report["results"]
    assert row["calls"] == 0 and row["latency_ms"]["p50"] is None     # a microsecond holds no call
    assert (tmp_path / "b.png").exists()


def test_each_measuring_thread_runs_with_the_threads_the_run_asked_for():
    """Found by probing: eager at batch 4 measured 13-32 ms a call instead of 0.02-0.04 ms.
    OpenMP's thread count is per thread; the copy set it in its main thread, and the GEMMs run
    in measure()'s threads took the OpenMP default (every CPU), a 2-thread team on one CPU.
    torch.get_num_threads() cannot show it: it applies torch's setting to the thread it asks
    from, so this reads OpenMP's own count, before any torch call in that thread."""
    import ctypes
    import threading
    from kiln.benchmark.child import measure
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(lib):
        pytest.skip("torch is not built with libgomp here")
    omp = ctypes.CDLL(lib)
    fresh = []   # what a new thread gets without being told: the check needs another count
    t = threading.Thread(target=lambda: fresh.append(omp.omp_get_max_threads()))
    t.start()
    t.join()
    asked = 1 if fresh[0] != 1 else 2
    seen = {}

    def run():
        seen.setdefault(threading.get_ident(), omp.omp_get_max_threads())
    before = torch.get_num_threads()
    try:
        measure(run, 2, 0.2, threads=asked)
    finally:
        torch.set_num_threads(before)
    # every measuring thread that ran (on a busy machine one may start after the window closed)
    assert seen and threading.get_ident() not in seen and set(seen.values()) == {asked}, seen


def test_a_copy_with_no_call_in_the_window_does_not_break_the_row():
    """Found by probing: --copies 2 where one copy finished no call: TypeError in max() over None."""
    from kiln.benchmark.report import aggregate
    done = {"calls": 2, "elapsed": 1.0, "latencies_ms": [1.0, 3.0], "max_ms": 3.0, "sum_ms": 4.0}
    idle = {"calls": 0, "elapsed": 1.0, "latencies_ms": [], "max_ms": None, "sum_ms": 0.0}
    row = aggregate("kiln", 1, 2, 1, [idle, done], [{}, {}], None)
    assert row["calls"] == 2 and row["latency_ms"]["max"] == 3.0
    assert aggregate("kiln", 1, 2, 1, [idle, idle], [{}, {}], None)["latency_ms"]["max"] is None


@pytest.mark.parametrize("argv", [["bench", "m.kiln", "--duration", "nan"], ["bench", "m.kiln", "--duration", "inf"],
                                  ["bench", "m.kiln", "--warmup", "nan"], ["bench", "m.kiln", "--price-per-hour", "inf"],
                                  ["monitor", "--period", "inf"], ["top", "--period", "nan"]])
def test_durations_and_periods_must_be_finite(argv, capsys):
    """Found by probing: kiln bench --duration nan measured forever (nan passed `<= 0`);
    kiln monitor --period inf was an OverflowError traceback from time.sleep."""
    from kiln.cli.app import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and "finite" in capsys.readouterr().err
    with pytest.raises(kiln.KilnError, match="finite"):
        kiln.bench("m.kiln", duration=float("nan"), quiet=True)


def test_output_paths_are_checked_before_measuring(tmp_path, monkeypatch):
    """Found by probing: an unwritable --json or a directory as --plot failed only after the whole
    run, and --plot /tmp left a stray /tmp.tmpPID.png next to it."""
    from kiln.benchmark import runner
    monkeypatch.setattr(runner, "_runners", lambda *a: pytest.fail("measured before checking the outputs"))
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    bad = [{"plot_path": str(tmp_path)}, {"json_path": str(tmp_path)}, {"json_path": "/proc/nope/b.json"}]
    if os.geteuid() != 0:
        bad.append({"json_path": str(tmp_path / "ro" / "b.json")})
    for kw in bad:
        with pytest.raises(kiln.KilnError, match="directory|cannot write"):
            kiln.bench("m.kiln", quiet=True, **kw)
    os.chmod(tmp_path / "ro", 0o700)
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(tmp_path.name)) == [tmp_path.name]
    from kiln.benchmark.report import write_json
    write_json(tmp_path / "out" / "r.json", {"results": []})
    assert os.listdir(tmp_path / "out") == ["r.json"]   # the temporary file renamed, in its own directory


def test_a_batch_too_large_for_memory_is_a_kiln_error_naming_its_size(kiln_cli, tmp_path):
    """Found by probing: an artifact's inputs made for a batch no memory holds ended in torch's
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes" (or, with no
    memory error at all, the out-of-memory killer). The size is checked before allocating."""
    torch.manual_seed(0)
    path = tmp_path / "mlp.kiln"
    kiln.trace(torch.nn.Sequential(torch.nn.Linear(16, 8)), torch.randn(2, 16), quiet=True).save(path)
    out_json = tmp_path / "bench.json"
    r = forkserver.run([kiln_cli, "bench", str(path), "--batch-sizes", "100000000000", "--copies", "1",
                        "--duration", "0.2", "--warmup", "0", "--quiet", "--json", str(out_json)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    (skipped,) = json.loads(out_json.read_text())["skipped"]
    reason = skipped["reason"]
    assert reason.startswith("KilnError: kiln bench: input ") and "at batch 100000000000" in reason, reason
    assert "needs 6400000000000 bytes" in reason and "--batch-sizes" in reason, reason
    assert "Allocator" not in r.stdout + r.stderr and "enforce fail" not in r.stdout + r.stderr
