"""kiln ls / monitor / top watching a model served by another process, and the registry behind them."""
import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from kiln.observe import registry
from tests import forkserver

CALLS = 17

SERVER = f"""
import sys, torch, kiln
m = kiln.trace(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()), torch.randn(2, 16),
               name="watched_mlp", quiet=True)
m.to_core(0)
before = m.calls   # 0: the validation run during trace is kiln's call, not counted
x = torch.randn(2, 16)
for _ in range({CALLS}):
    m(x)
print("ready", m.calls - before, m.calls, flush=True)
sys.stdin.readline()
"""


def _env(run_dir):
    return dict(os.environ, KILN_RUN_DIR=str(run_dir), KILN_HEARTBEAT_S="0.2", KILN_NUM_CORES="2")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env(run_dir))
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], f"server did not start: {line}"
        assert int(line[1]) == CALLS
        time.sleep(0.5)   # a heartbeat after the last call
        yield proc, run_dir, int(line[2])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _kiln(kiln_cli, run_dir, *args, timeout=120):
    r = forkserver.run([kiln_cli, *args, "--run-dir", str(run_dir)], capture_output=True, text=True,
                       timeout=timeout, env=_env(run_dir))
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_ls_sees_the_served_model(served, kiln_cli):
    proc, run_dir, total = served
    info = json.loads(_kiln(kiln_cli, run_dir, "ls", "--json"))
    procs = [p for p in info["processes"] if p["pid"] == proc.pid]
    assert len(procs) == 1, info["processes"]
    (model,) = procs[0]["models"]
    assert model["name"] == "watched_mlp" and model["core"] == 0
    assert model["calls_completed"] == total and model["calls_failed"] == 0
    assert procs[0]["memory_rss_bytes"] > 10 * 2**20
    table = _kiln(kiln_cli, run_dir, "ls")
    assert "watched_mlp" in table and str(proc.pid) in table


def test_monitor_reports_in_neuron_monitors_shape(served, kiln_cli):
    proc, run_dir, total = served
    out = _kiln(kiln_cli, run_dir, "monitor", "--period", "0.3", "--count", "2").strip().splitlines()
    assert len(out) == 2
    first, second = (json.loads(line) for line in out)
    (rt,) = [r for r in first["neuron_runtime_data"] if r["pid"] == proc.pid]
    stats = rt["report"]["execution_stats"]
    # first sight of the process: the period's counts cover its life so far
    assert stats["execution_summary"]["completed"] == total
    assert stats["execution_summary"]["failed"] == 0 and stats["execution_summary"]["timed_out"] == 0
    lat = stats["latency_stats"]["total_latency"]
    assert 0 < lat["p0"] <= lat["p50"] <= lat["p99"] <= lat["p100"] < 5.0
    assert rt["report"]["memory_used"]["neuron_runtime_used_bytes"]["host"] > 10 * 2**20
    assert rt["report"]["neuroncore_counters"]["neuroncores_in_use"]["0"]["models"] == ["watched_mlp"]
    assert rt["report"]["models"][0]["completed_total"] == total
    # no calls between the two reports: the second period is empty
    (rt2,) = [r for r in second["neuron_runtime_data"] if r["pid"] == proc.pid]
    assert rt2["report"]["execution_stats"]["execution_summary"]["completed"] == 0
    assert rt2["report"]["execution_stats"]["latency_stats"]["total_latency"] is None
    for report in (first, second):
        assert set(report) >= {"period", "neuron_runtime_data", "system_data", "instance_info",
                               "neuron_hardware_info"}
        assert report["system_data"]["memory_info"]["memory_total_bytes"] > 0
        assert "average_usage" in report["system_data"]["vcpu_usage"]
        assert report["neuron_hardware_info"]["neuroncore_count"] == 2


def test_top_renders_headless_in_80_columns(served, kiln_cli):
    proc, run_dir, total = served
    out = _kiln(kiln_cli, run_dir, "top", "--once", "--period", "0.3", "--width", "80")
    rows = [line for line in out.splitlines() if "watched_mlp" in line and str(proc.pid) in line]
    assert rows, out
    assert str(total) in rows[0].split()
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_top_is_interactive_in_a_terminal_and_q_quits(served, kiln_cli):
    _, run_dir, _ = served
    pid, fd = pty.fork()
    if pid == 0:   # child: kiln top on a pseudo-terminal, as over ssh
        os.environ.update(_env(run_dir), COLUMNS="80", LINES="24", TERM="xterm")
        os.execv(kiln_cli, [kiln_cli, "top", "--period", "0.2", "--run-dir", str(run_dir)])
    screen, deadline = b"", time.monotonic() + 60
    try:
        while b"watched_mlp" not in screen and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                screen += os.read(fd, 65536)
        assert b"watched_mlp" in screen, screen[-2000:]
        os.write(fd, b"q")
        end = time.monotonic() + 15
        while time.monotonic() < end:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                break
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
        else:
            pytest.fail("kiln top did not quit on 'q'")
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_exited_process_is_forgotten(served, kiln_cli):
    proc, run_dir, _ = served
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(timeout=30)
    info = json.loads(_kiln(kiln_cli, run_dir, "ls", "--json"))
    assert [p for p in info["processes"] if p["pid"] == proc.pid] == []
    assert not os.path.exists(os.path.join(run_dir, registry.entry_name(proc.pid)))   # withdrawn at exit


def test_registry_drops_killed_and_silent_processes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import psutil
    me = psutil.Process()
    now = time.time()
    entries = {
        f"kiln-{dead.pid}.json": {"pid": dead.pid, "create_time": now, "heartbeat": now, "period": 1},   # SIGKILLed
        f"kiln-{me.pid}.json": {"pid": me.pid, "create_time": me.create_time(), "heartbeat": now, "period": 1,
                                "models": []},
    }
    for name, e in entries.items():
        (tmp_path / name).write_text(json.dumps(e))
    (tmp_path / "torn.json.123.tmp").write_text("{")   # an unfinished write is never read
    live = registry.processes(str(tmp_path))
    assert [e["pid"] for e in live] == [me.pid] and live[0]["heartbeat"] == now
    assert sorted(os.listdir(tmp_path)) == [f"kiln-{me.pid}.json", "torn.json.123.tmp"]
    for stale in ({"pid": me.pid, "create_time": me.create_time(), "heartbeat": now - 60, "period": 1},   # silent
                  {"pid": me.pid, "create_time": me.create_time() - 1000, "heartbeat": now, "period": 1}):  # reused
        (tmp_path / f"kiln-{me.pid}.json").write_text(json.dumps(stale))
        assert registry.processes(str(tmp_path)) == []
        assert not (tmp_path / f"kiln-{me.pid}.json").exists()


def test_registry_never_touches_files_that_are_not_its_heartbeats(tmp_path):
    """`--run-dir .` in a project deleted package.json: every *.json that was not a live heartbeat went."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    foreign = {
        "package.json": '{"name": "my-project", "version": "1.0"}',
        "settings.json": '{"a": 1}',
        f"{dead.pid}.json": json.dumps({"pid": dead.pid, "create_time": 1.0, "heartbeat": 1.0, "period": 1}),
        "kiln-123.json": "[1, 2]",                                                   # not an object
        "kiln-124.json": json.dumps({"pid": 124, "period": "fast", "heartbeat": 0, "create_time": 1}),
        "kiln-125.json": json.dumps({"pid": 7, "period": 1, "heartbeat": 0, "create_time": 1}),   # not its pid
        "kiln-126.json": "{not json",
    }
    for name, text in foreign.items():
        (tmp_path / name).write_text(text)
    assert registry.processes(str(tmp_path)) == []   # what kiln ls, monitor and top read
    assert {n: (tmp_path / n).read_text() for n in os.listdir(tmp_path)} == foreign
