"""Background compiles (the default) run in a compile process of kiln's own
(kiln.device.compile_process): the training thread never sees torch.export's process-wide
"compiling" flag, a child that dies leaves the program running op by op with a warning,
a graph pickle cannot take compiles in-process, and a process that ends mid-compile
kills its child rather than waiting for it or leaving it behind."""
import copy
import os
import sys
import textwrap
import warnings

import psutil
import pytest
import torch

from kiln.device import compile_process, metrics, modes
from kiln.device import programs as device_programs
from tests.conftest import run_py

DEV = modes.device()


@pytest.fixture(autouse=True)
def _fresh():
    metrics.clear()
    modes.forget_compiled()
    modes.set_mode("lazy", optlevel=1, background="auto")     # background compiles: the default
    yield
    modes.wait_compiles()
    modes.set_mode("eager", background="auto")


class Probe(torch.nn.Module):
    """An MLP that notes whether torch says it is compiling each time it runs."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.compiling = []

    def forward(self, x):
        self.compiling.append(torch.compiler.is_compiling())
        return self.net(x)


def _train(model, steps, device=None, wait=True):
    """Losses of ``steps`` AdamW steps; on the device, waiting for the compiles after every
    step (``wait=True``) or once, after step ``wait`` (an int), letting the others overlap."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x.to(device or "cpu")) - y.to(device or "cpu")) ** 2).mean()
        loss.backward()
        opt.step()
        if device is not None:
            modes.mark_step()
        losses.append(float(loss.detach()))
        if device is not None and (wait is True or wait == len(losses)):
            modes.wait_compiles()
    return losses


def test_background_compiles_run_in_a_child_and_take_over():
    torch.manual_seed(0)
    ref = Probe()
    model = copy.deepcopy(ref).to(DEV)
    expected = _train(ref, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # every program compiled
        got = _train(model, 6, DEV, wait=4)                     # the first steps overlap the compiles
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert metrics.counter_value("BackgroundCompile") >= 1 and metrics.counter_value("UncachedCompile") >= 1
    assert metrics.counter_value("SwappedIn") >= 1             # the last steps ran a compiled program
    child = compile_process.shared()._proc
    assert child is not None and child.poll() is None and child.pid != os.getpid()
    assert not any(model.compiling), "the training thread saw torch.export's compiling flag"


def test_the_child_compiles_with_kilns_settings_of_the_moment(monkeypatch, tmp_path):
    """The child was started under the suite's settings (compile cache off); a compile cache
    named afterwards is the one its next compile fills."""
    torch.manual_seed(0)
    _train(copy.deepcopy(Probe().net).to(DEV), 2, DEV)
    assert compile_process.shared()._proc is not None and metrics.counter_value("UncachedCompile") >= 1
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_URL", str(cache))
    modes.forget_compiled()
    _train(copy.deepcopy(torch.nn.Sequential(torch.nn.Linear(8, 2))).to(DEV), 2, DEV)
    assert cache.is_dir() and any(p.is_file() for p in cache.rglob("*")), "the child ignored the new cache"


def test_a_forked_copy_of_the_process_leaves_the_compile_process_alone():
    """A DataLoader's fork workers, or OpenVINO's telemetry (it forks at ``import openvino``
    outside CI), run threading's exit hooks as they end: the compile process's own cleanup
    ran there too, killed the parent's compile process and removed its directory, and the
    parent's next compile failed (a bf16 step's Inductor upgrade never came)."""
    import multiprocessing
    torch.manual_seed(0)
    _train(copy.deepcopy(Probe().net).to(DEV), 2, DEV)
    process = compile_process.shared()
    child, directory = process._proc, process._dir
    assert child is not None and child.poll() is None
    fork = multiprocessing.get_context("fork").Process(target=int)
    fork.start()
    fork.join(30)
    assert fork.exitcode == 0
    assert child.poll() is None, "a forked copy's exit killed the compile process"
    assert os.path.isdir(directory), "a forked copy's exit removed the compile process's directory"
    modes.forget_compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # the next compile works
        _train(copy.deepcopy(torch.nn.Sequential(torch.nn.Linear(8, 2))).to(DEV), 2, DEV)
    assert compile_process.shared()._proc is child


def test_a_compile_asked_for_as_the_process_exits_starts_nothing_and_leaves_nothing(monkeypatch, tmp_path):
    """A step's last flush as a script ends asks for a compile on the compile thread, which
    Python joins after threading's exit hooks ran; registering the compile process's own
    hook then fails. It made its directory first, and every such run left an empty one in
    the temporary folder (177 here after a day of tests). Now nothing is made or started:
    the program runs op by op."""
    import threading

    def exiting(hook):
        raise RuntimeError("can't register atexit after shutdown")
    monkeypatch.setattr(threading, "_register_atexit", exiting)
    monkeypatch.setattr(compile_process, "_SHARED", [])
    monkeypatch.setattr(compile_process.tempfile, "tempdir", str(tmp_path))
    torch.manual_seed(0)
    ref = Probe().net
    got = _train(copy.deepcopy(ref).to(DEV), 3, DEV)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_train(copy.deepcopy(ref), 3)), rtol=1e-5, atol=1e-6)
    process = compile_process.shared()
    assert process._proc is None and process._dir is None
    assert list(tmp_path.glob("kiln-device-compile-*")) == [], "a compile at exit left a directory behind"
    assert metrics.counter_value("UncachedCompile") == 0


def test_a_child_that_dies_leaves_the_program_op_by_op(monkeypatch):
    torch.manual_seed(0)
    ref = Probe().net
    model = copy.deepcopy(ref).to(DEV)
    python = sys.executable
    monkeypatch.setattr(compile_process, "_SHARED", [])          # a compile process of this test's
    monkeypatch.setattr(sys, "executable", "/bin/false")         # that ends at once
    with pytest.warns(RuntimeWarning, match="runs eagerly.*compile process ended"):
        got = _train(model, 3, DEV)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_train(copy.deepcopy(ref), 3)), rtol=1e-5, atol=1e-6)
    assert metrics.counter_value("UncachedCompile") == 0
    # the next compile starts a new child
    monkeypatch.setattr(sys, "executable", python)
    modes.forget_compiled()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _train(model, 2, DEV)
    assert metrics.counter_value("UncachedCompile") >= 1 and metrics.counter_value("SwappedIn") >= 1, \
        metrics.report()
    compile_process.shared().close()


def test_the_compile_process_imports_the_parents_kiln_whatever_the_working_directory(monkeypatch, tmp_path):
    """A training script run from a directory that holds another ``kiln`` (a checkout) still
    has its programs compiled by its own kiln: the child does not take modules from the
    working directory, where ``python -m`` would have put it first."""
    decoy = tmp_path / "kiln"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the kiln in the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compile_process, "_SHARED", [])          # a compile process started here
    torch.manual_seed(0)
    ref = Probe().net
    model = copy.deepcopy(ref).to(DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)            # a child that died would warn
        got = _train(model, 3, DEV)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_train(copy.deepcopy(ref), 3)), rtol=1e-5, atol=1e-6)
    assert metrics.counter_value("UncachedCompile") >= 1 and metrics.counter_value("SwappedIn") >= 1, \
        metrics.report()
    compile_process.shared().close()


def test_a_graph_pickle_cannot_take_compiles_in_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise TypeError("cannot pickle 'generator' object")
    monkeypatch.setattr(compile_process.pickle, "dump", refuse)
    torch.manual_seed(0)
    ref = Probe().net
    model = copy.deepcopy(ref).to(DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _train(model, 3, DEV)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_train(copy.deepcopy(ref), 3)), rtol=1e-5, atol=1e-6)
    assert metrics.counter_value("UncachedCompile") >= 1 and metrics.counter_value("SwappedIn") >= 1


def test_a_process_that_ends_mid_compile_kills_its_child(tmp_path):
    """The script starts a CNN step's compile (Inductor's C++ build: many seconds) and ends
    at once; its compile process must be gone when it has, not left compiling, and the
    build it abandoned is no failure to warn about (it had said the graph "runs eagerly
    (not compiled): the compile process ended")."""
    script = textwrap.dedent("""
        import time
        import torch
        from kiln.device import compile_process, modes
        dev = modes.device()
        modes.set_mode("lazy", engine="inductor", optlevel=1)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                  torch.nn.Linear(800, 2)).to(dev)
        out = net(torch.randn(2, 3, 12, 12).to(dev)).sum()
        out.backward()
        modes.mark_step()
        for _ in range(600):             # the compile thread starts the child: wait for it
            proc = compile_process.shared()._proc
            if proc is not None:
                break
            time.sleep(0.05)
        assert proc is not None and proc.poll() is None, "no compile process under way"
        print("CHILD", proc.pid, flush=True)
    """)
    r = run_py(script, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    pid = int(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("CHILD")))
    alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert not alive, "the compile process outlived the process that started it"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "runs eagerly" not in r.stderr and "compile process ended" not in r.stderr, r.stderr[-3000:]


def test_a_program_runs_in_partitions_first_and_whole_once_it_repeats():
    """A program ONNX Runtime would split around a host operation (``lgamma``) is built in
    partitions first (seconds), runs so, and, once it runs again, is built whole on Inductor
    (``whole_graph``'s engine, a C++ build) and swapped in (``UpgradedIn``); every step's
    answer equals CPU eager's, before, during and after both swaps. A program run once is
    never built whole."""
    modes.set_mode("lazy", optlevel=1, background="auto")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g)
    wd = w.to(DEV)
    z = torch.rand(3, 16, generator=g) + 0.5
    once = z.to(DEV).lgamma().exp()                   # a one-off program
    modes.mark_step()
    for i in range(8):
        x = torch.rand(8, 16, generator=g) + 0.5
        out = (torch.lgamma(x.to(DEV) @ wd.abs()) * 2).sum(1)
        modes.mark_step()
        torch.testing.assert_close(out.cpu(), (torch.lgamma(x @ w.abs()) * 2).sum(1), rtol=1e-5, atol=1e-5)
        if i in (1, 4):
            modes.wait_compiles()    # 1: the partitions are in; 4: the whole graph is, asked for at step 2
    assert metrics.counter_value("SwappedIn") >= 1 and metrics.counter_value("UpgradedIn") == 1, metrics.report()
    (run,) = [e.run for e in device_programs._programs.values() if e.seen > 2]
    assert [p["engine"] for p in run.compiled.manifest["partitions"]] == ["inductor"]
    # the one-off and the step: each built once in partitions, the step once whole
    assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") == 3
    torch.testing.assert_close(once.cpu(), z.lgamma().exp(), rtol=1e-5, atol=1e-6)


def test_a_whole_graph_build_takes_over_only_when_it_measured_faster():
    """At -O2 both builds are timed: the whole graph replaces the partitions only when its
    time is under theirs (theirs leave out the host operations, so a tie keeps them); an
    upgrade that came back uncompiled never replaces them; untimed builds (-O1) do."""
    from types import SimpleNamespace

    from kiln.device import graphs

    def run(ms):
        manifest = {} if ms is None else {"speed_vs_eager": {"latency_ms": ms}}
        return SimpleNamespace(compiled=SimpleNamespace(manifest=manifest))
    assert graphs.faster(run(100.0), run(150.0))
    assert not graphs.faster(run(150.0), run(150.0)) and not graphs.faster(run(200.0), run(150.0))
    assert metrics.counter_value("UpgradeSlower") == 2
    assert not graphs.faster(SimpleNamespace(compiled=None), run(150.0))
    assert graphs.faster(run(None), run(150.0)) and graphs.faster(run(100.0), run(None))


def test_a_program_kept_on_eagers_kernels_is_offered_to_inductor_after_it_repeats():
    """``graphs.later_build``: a program -O2 kept on eager's kernels (every partition timed
    slower on its engine, as ONNX Runtime's convolution gradients were for a CNN's step) is
    built whole on Inductor once it has run ``LOST_TO_EAGER_RUNS`` more times, held to
    eager's speed (``engine_by="whole_graph"``, not the user's final choice), and so is one on
    an engine whose run took ``INDUCTOR_WORTH_MS`` or more; nothing more is due for a smaller
    one, one already on Inductor, one -O1 did not time, one pinned to an engine by the user,
    or with ``whole_graph=False``; a program in partitions gets its whole graph at once, and
    one already whole on another engine (OpenVINO's bf16 step) only where worth a build."""
    from types import SimpleNamespace

    from kiln.device import graphs

    def run(*engines, on="onnxruntime", later=None, ms=1.0, host_ops=True):
        steps = [{"partition": i} for i in range(len(engines))] + ([{"op": "aten::nonzero"}] if host_ops else [])
        return SimpleNamespace(compiled=SimpleNamespace(manifest={
            "engine": {"name": on}, "partitions": [{"engine": e} for e in engines], "whole_graph_later": later,
            "program": {"steps": steps}, "speed_vs_eager": None if ms is None else {"latency_ms": ms}}))
    options = {"optlevel": 2, "whole_graph": "later"}
    got = graphs.later_build(run("eager"), options)
    assert got == ({"optlevel": 2, "whole_graph": "later", "engine": "inductor", "engine_by": "whole_graph"},
                   graphs.LOST_TO_EAGER_RUNS)
    assert graphs.later_build(run("eager", "eager"), options)[0]["engine"] == "inductor"
    # on an engine: Inductor is tried only where the run is worth a C++ build
    assert graphs.later_build(run("eager", "onnxruntime"), options) is None
    assert graphs.later_build(run("onnxruntime"), options) is None
    worth = graphs.INDUCTOR_WORTH_MS
    assert graphs.later_build(run("onnxruntime", ms=worth), options)[0]["engine"] == "inductor"
    assert graphs.later_build(run("onnxruntime", "inductor", ms=worth), options) is None
    assert graphs.later_build(run("eager", ms=None), options) is None          # untimed (-O1): nothing to beat
    assert graphs.later_build(run("eager", on="inductor"), options) is None
    assert graphs.later_build(run("eager"), {**options, "engine": "onnxruntime"}) is None
    assert graphs.later_build(run("eager"), {**options, "whole_graph": False}) is None
    assert graphs.later_build(SimpleNamespace(compiled=None), options) is None
    assert graphs.later_build(run("onnxruntime", later="inductor"), options) == (
        {**options, "whole_graph": True}, 0)
    # already whole on one engine (a bf16 step on OpenVINO): Inductor only where worth it
    whole = dict(on="openvino", later="inductor", host_ops=False)
    assert graphs.later_build(run("openvino", **whole), options) is None
    assert graphs.later_build(run("openvino", ms=None, **whole), options) is None
    assert graphs.later_build(run("openvino", ms=worth, **whole), options) == ({**options, "whole_graph": True}, 0)
    # and kiln.trace takes engine_by (a phase's choice, held to eager's speed), checked
    import kiln
    from kiln.errors import CompilerArgsError
    with pytest.raises(CompilerArgsError, match="engine_by"):
        kiln.trace(torch.nn.Linear(2, 2), torch.randn(1, 2), engine_by="someone", cache=False)


def test_a_build_due_later_is_asked_for_after_its_runs_and_swapped_in(monkeypatch):
    """The flush's side of a later build: asked for only once the program has run the runs
    ``later_build`` named, ``build_due`` says so until then (a benchmark steps on while it
    does), and the build that measured faster takes over (``UpgradedIn``) with every step's
    answer equal to CPU eager's."""
    from types import SimpleNamespace

    from kiln.device import graphs
    asked = []
    monkeypatch.setattr(graphs, "later_build", lambda run, options: ({**options, "marker": 1}, 3))

    def upgrade(gm, examples, name, options):
        asked.append(options.get("marker"))
        faster = lambda *args: gm(*args)                       # noqa: E731 - eager's answer
        faster.compiled = SimpleNamespace(manifest={"speed_vs_eager": {"latency_ms": 0.001}})
        return faster
    monkeypatch.setattr(graphs, "upgrade", upgrade)
    modes.set_mode("lazy", optlevel=1, background="auto")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g)
    wd = w.to(DEV)
    due = []
    for i in range(9):
        x = torch.rand(8, 16, generator=g)
        out = torch.tanh(x.to(DEV) @ wd).sum(1)
        modes.mark_step()
        torch.testing.assert_close(out.cpu(), torch.tanh(x @ w).sum(1), rtol=1e-5, atol=1e-5)
        modes.wait_compiles()
        due.append(device_programs.build_due())
    assert asked == [1], asked
    assert metrics.counter_value("UpgradedIn") == 1, metrics.report()
    first = due.index(True)
    # due from the compile until the third run after it asked for the build, then never again
    assert due[first:first + 3] == [True] * 3 and not any(due[first + 3:]), due


def test_the_compile_process_threads_yield_instead_of_spinning(monkeypatch):
    from kiln.engines import onnxruntime as ort_engine
    from kiln.runtime import options
    monkeypatch.setattr(options, "_SPIN", [True])
    assert options.RuntimeOptions().spin
    options.yield_threads()
    assert not options.RuntimeOptions().spin
    assert options.RuntimeOptions(spin=True).spin          # a caller's own choice stands
    so = ort_engine._session_options(options.RuntimeOptions())
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    # and the child itself: OpenMP's threads sleep when idle unless the user said otherwise
    torch.manual_seed(0)
    _train(Probe().to(DEV), 2, DEV)
    child = compile_process.shared()._proc
    expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert psutil.Process(child.pid).environ().get("OMP_WAIT_POLICY") == expected
