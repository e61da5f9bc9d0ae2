"""The inductor engine (AOTInductor): compiled partitions match eager, travel, and run from threads.

Each AOTInductor compile runs g++ for 15-30 s here, so every model is compiled
once per module and the tests share it.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kiln
from kiln.engines import inductor, inductor_lean
from kiln.host.cores import available_cpus
from tests import models
from tests.conftest import assert_close, run_py

pytestmark = pytest.mark.skipif(
    inductor.compiler() is None,
    reason="the inductor engine needs a C++ compiler (g++) to compile; none found on PATH")

TOL = {"atol": 1e-4, "rtol": 1e-4}


BUILDS: list = []      # what the mlp fixture's compile did: (event, g++ source or None, thread)


@pytest.fixture(scope="module")
def mlp():
    """The MLP compiled once; its compile's exports and g++ builds are recorded in BUILDS."""
    from torch._inductor.cpp_builder import CppBuilder
    model, x = models.mlp()
    build, export = CppBuilder.build, torch.export.export

    def spied_build(self):
        source = str(getattr(self, "_sources_args", "")).rsplit(".", 2)
        kind = (".".join(source[-2:]) if getattr(self, "_compile_only", False) else
                "link" if getattr(self, "_do_link", False) else "header")
        BUILDS.append(("start", kind, threading.current_thread().name))
        build(self)
        BUILDS.append(("end", kind, threading.current_thread().name))

    def spied_export(*args, **kwargs):
        BUILDS.append(("export", None, threading.current_thread().name))
        return export(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CppBuilder, "build", spied_build)
        mp.setattr(torch.export, "export", spied_export)
        compiled = kiln.trace(model, x, engine="inductor", cache=False)
    return model, x, compiled


def _runner(compiled, i=0):
    return compiled.program.partitions[i]


def test_mlp_matches_eager(mlp):
    model, x, compiled = mlp
    assert_close(compiled(x), model(x).detach(), **TOL)
    x2 = torch.randn_like(x)
    assert_close(compiled(x2), model(x2).detach(), **TOL)
    m = compiled.manifest
    assert m["engine"] == {"name": "inductor", "version": torch.__version__}
    assert m["report"]["support_percentage"] == 100.0
    assert [p["engine"] for p in m["partitions"]] == ["inductor"]
    assert m["partitions"][0]["blob"].endswith(".pt2")
    assert m["validation"]["passed"] and m["validation"]["max_abs_error"] < 1e-5
    # the library is driven through its C interface, which releases the GIL
    assert type(_runner(compiled).model).__name__ == "ContainerModel"


def test_non_contiguous_input(mlp):
    """Inductor specialises on strides; a transposed view of the right shape still gives the right answer."""
    model, _, compiled = mlp
    xt = torch.randn(16, 2).t()
    assert not xt.is_contiguous()
    assert_close(compiled(xt), model(xt).detach(), **TOL)


class _TransposedWeight(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w) + 1


def test_a_transposed_input_is_compiled_as_it_is_and_every_layout_answers(tmp_path):
    """A dense non-contiguous example input (a linear layer's weight, transposed, as a
    device program takes it) is compiled in its own layout, recorded in the package: calls
    in that layout pass it without a copy, calls in any other are copied into it, and the
    answers are eager's either way, after a save and a load in a fresh process too."""
    model = _TransposedWeight()
    x, w = torch.randn(4, 64), torch.randn(32, 64).t()
    compiled = kiln.trace(model, (x, w), engine="inductor", optlevel=1, cache=False)
    runner = _runner(compiled)
    assert runner._strides == [(64, 1), (1, 64)]
    assert inductor._as_compiled(w, runner._strides[1]) is w           # no copy
    again = inductor._as_compiled(w.contiguous(), runner._strides[1])
    assert again.stride() == (1, 64) and torch.equal(again, w)
    for given in (w, w.contiguous(), torch.randn(64, 64)[:, :32]):
        assert_close(compiled(x, given), model(x, given), **TOL)
    path = tmp_path / "t.kiln"
    compiled.save(path)
    torch.save((x, w.contiguous(), model(x, w)), tmp_path / "io.pt")
    code = f"""
import torch, kiln
m = kiln.load({str(path)!r})
x, w, y = torch.load({str(tmp_path / 'io.pt')!r})
torch.testing.assert_close(m(x, w), y, atol=1e-4, rtol=1e-4)
torch.testing.assert_close(m(x, w.t().contiguous().t()), y, atol=1e-4, rtol=1e-4)
print('OK')
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_load_in_fresh_process_without_model_code_or_compiler(mlp, tmp_path):
    model, x, compiled = mlp
    path = tmp_path / "mlp.kiln"
    compiled.save(path)
    torch.save(x, tmp_path / "x.pt")
    torch.save(model(x).detach(), tmp_path / "y.pt")
    code = f"""
import sys, torch, kiln
m = kiln.load({str(path)!r})
x = torch.load({str(tmp_path / 'x.pt')!r}); y = torch.load({str(tmp_path / 'y.pt')!r})
torch.testing.assert_close(m(x), y, atol=1e-4, rtol=1e-4)
assert m.manifest['partitions'][0]['engine'] == 'inductor'
assert not any(k.startswith('tests') for k in sys.modules), 'model code was imported'
assert 'torch._inductor' not in sys.modules, 'loading imported torch._inductor (seconds of dynamo imports)'
from kiln.engines import inductor, inductor_lean
from kiln.host.cores import available_cpus
assert inductor.compiler() is None, 'a C++ compiler is visible'
print('OK')
"""
    # No compiler on PATH: loading a compiled library must not need one.
    r = run_py(code, cwd=str(tmp_path), env={"PATH": str(tmp_path / "empty"), "CXX": ""})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_concurrent_calls_from_threads(mlp):
    model, _, compiled = mlp
    loaded = kiln.load(compiled.to_bytes(), threads=1)   # reuses the compiled library
    xs = [torch.randn(2, 16) for _ in range(64)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(loaded, xs))
    for x, y in zip(xs, outs):
        assert_close(y, model(x).detach(), **TOL)
    assert loaded.calls >= 64


class _RecordingOpenMP:
    def __init__(self, real):
        self.real, self.calls = real, []

    def omp_get_max_threads(self):
        return self.real.omp_get_max_threads()

    def omp_set_num_threads(self, n):
        self.calls.append((threading.get_ident(), n))
        self.real.omp_set_num_threads(n)


def test_threads_option_applies_per_call_and_is_restored(mlp):
    model, x, compiled = mlp
    loaded = kiln.load(compiled.to_bytes(), threads=1)
    runner = _runner(loaded)
    assert runner.threads == 1 and runner._omp is not None, "torch's OpenMP runtime was not found"
    recorder = runner._omp = _RecordingOpenMP(runner._omp)
    process_wide = torch.get_num_threads()
    # a process-wide count other than the call's 1 (the suite's workers run at 1 thread:
    # tests/conftest.py), so that a call that leaked its count would show
    torch.set_num_threads(2)
    try:
        _check_threads_per_call(loaded, model, x, recorder)
    finally:
        torch.set_num_threads(process_wide)


def _check_threads_per_call(loaded, model, x, recorder):
    before = torch.get_num_threads()

    def call():
        assert_close(loaded(x), model(x).detach(), **TOL)
        return threading.get_ident(), torch.get_num_threads()

    me = call()
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(call).result()
    assert torch.get_num_threads() == before == me[1]    # nothing process-wide changed
    assert [n for _, n in recorder.calls][0::2] == [1, 1]   # 1 thread during each call...
    assert {t for t, _ in recorder.calls} == {me[0], other[0]}   # ...set on the calling thread only
    assert recorder.calls[1] == (me[0], before)            # and restored after


class _MeanOfSquares(torch.nn.Module):
    """A sum divided in place by a count, in the kernel of a parallel loop that reads the sum:
    the shape of a training step's mean loss beside its gradients."""

    def forward(self, a, b, n):
        s = (b * b).sum()
        return a * s, s / n


def test_a_build_made_with_one_thread_answers_when_run_with_two():
    # Inductor 2.13 guards a parallel region's scalar stores (`omp single`) only when it
    # plans for several threads: planned for the compiling process's one thread and run
    # with two, `s / n` was divided twice (a BERT step's loss, found by probing 12-03)
    model = _MeanOfSquares()
    example = (torch.randn(64, 256), torch.randn(100), torch.tensor(4))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:        # unvalidated: this test is about the kernel, not the check that might catch it
        compiled = kiln.trace(model, example, engine="inductor", validate=False, cache=False)
    finally:
        torch.set_num_threads(previous)
    loaded = kiln.load(compiled.to_bytes(), threads=2)
    for _ in range(3):
        assert_close(loaded(*example), model(*example), **TOL)


class _Labels(torch.nn.Module):
    def forward(self, a, labels):
        return a * 2, labels.clone()


def test_an_input_sliced_in_the_example_is_read_as_given():
    # capture traced the (2, 7) slice in its own layout (strides (8, 1)) and kiln compiles it
    # contiguous; Inductor planned its reads from capture's record, so until 12-03 the second
    # row came back shifted by one (a T5 step's shifted labels, found by probing)
    labels = torch.arange(16).view(2, 8)[:, :-1]
    example = (torch.randn(4, 4), labels)
    compiled = kiln.trace(_Labels(), example, engine="inductor", validate=False, cache=False)
    for given in (labels, labels.contiguous()):
        torch.testing.assert_close(compiled(example[0], given)[1], labels, rtol=0, atol=0)


def test_other_torch_version_is_refused(mlp, monkeypatch):
    _, _, compiled = mlp
    data = compiled.to_bytes()
    monkeypatch.setattr(torch, "__version__", "9.1.0")
    with pytest.raises(kiln.ArtifactError, match=r"compiled with torch 2\.\d+.*this process has torch 9\.1\.0"):
        kiln.load(data)


def test_custom_ops_stay_on_host():
    model, x = models.custom_op()
    rep = kiln.analyze(model, x, engine="inductor")
    (op,) = [u for u in rep.unsupported_ops if u["engine_unsupported"]]
    assert op["op"] == "kilntest::odd_scale" and "custom operator" in op["reason"]
    assert len(rep.partitions) == 2 and rep.host_ops == 1   # the linears either side still compile


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(inductor, "compiler", lambda: None)
    model, x = models.mlp()
    with pytest.raises(kiln.CompileError, match="needs a C\\+\\+ compiler"):
        kiln.trace(model, x, engine="inductor")


@pytest.mark.slow
def test_tiny_bert_matches_eager():
    model = models.tiny_bert()
    inputs = models.bert_inputs()
    compiled = kiln.trace(model, inputs, engine="inductor")
    assert {p["engine"] for p in compiled.manifest["partitions"]} == {"inductor"}
    out, ref = compiled(**inputs), model(**inputs)
    assert_close(out.last_hidden_state, ref.last_hidden_state.detach(), **TOL)
    assert_close(out.pooler_output, ref.pooler_output.detach(), **TOL)
    ids = inputs["input_ids"].clone()
    ids[-1, 12:] = 7  # only masked positions change
    changed = compiled(input_ids=ids, attention_mask=inputs["attention_mask"]).last_hidden_state
    assert_close(changed[-1, :8], out.last_hidden_state[-1, :8], **TOL)


@pytest.mark.slow
def test_op_without_c_shim_runs_through_torch_loader():
    """linalg.det has no AOTInductor C shim: it needs torch's proxy executor, so torch's package loader."""
    class Det(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.det(x.reshape(-1, 2, 2) + 3) * 2

    model, x = Det(), torch.randn(4, 8)
    compiled = kiln.trace(model, x, engine="inductor")
    assert type(_runner(compiled).model).__name__ == "PackageModel"
    assert_close(compiled(x), model(x), **TOL)
    loaded = kiln.load(compiled.to_bytes(), threads=1)
    xs = [torch.randn(4, 8) for _ in range(16)]
    with ThreadPoolExecutor(4) as pool:
        for x2, y in zip(xs, pool.map(loaded, xs)):
            assert_close(y, model(x2), **TOL)


def test_the_wrapper_is_built_without_aotinductors_per_input_checks(mlp):
    """kiln checks inputs itself, so AOTInductor's check_input_N functions (run only under
    AOTI_RUNTIME_CHECK_INPUTS) are left out of the wrapper it compiles; torch's code
    generator is unchanged outside kiln's compile."""
    import io
    import zipfile

    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    from kiln.engines.inductor_lean import _without_checks
    model, x, compiled = mlp
    blob = compiled._artifact.blobs[compiled.manifest["partitions"][0]["blob"]]
    with zipfile.ZipFile(io.BytesIO(bytes(blob))) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    assert "check_input_0" not in wrapper
    assert "__check_inputs_outputs(input_handles, output_handles)" in wrapper     # called, empty
    assert "_check_aoti_runtime_check_inputs_env()" in wrapper
    assert CppWrapperCpu.generate_input_output_runtime_checks is not _without_checks
    with pytest.raises(kiln.InputError):                 # kiln's own check still refuses
        compiled(torch.randn(3, 3))
    assert_close(compiled(x), model(x).detach(), **TOL)


def test_a_partition_goes_to_aotinductor_without_another_export_and_the_wrapper_beside_the_kernels(mlp):
    """The captured ATen graph is compiled as it is (no second torch.export of the partition),
    and AOTInductor's wrapper compiles on a thread beside its kernels, the link after both."""
    model, x, compiled = mlp
    assert_close(compiled(x), model(x).detach(), **TOL)
    assert compiled.manifest["partitions"][0]["engine"] == "inductor"
    events = [(e, kind) for e, kind, _ in BUILDS]
    threads = {kind: name for e, kind, name in BUILDS if e == "start"}
    assert ("export", None) not in events, events         # the engine did not export the partition again
    assert {"wrapper.cpp", "kernel.cpp", "link"} <= set(threads), events
    if available_cpus() >= 2:
        assert threads["wrapper.cpp"] != threads["kernel.cpp"] == threads["link"]
        assert events.index(("start", "kernel.cpp")) < events.index(("end", "wrapper.cpp"))
    assert events.index(("end", "wrapper.cpp")) < events.index(("start", "link"))
    assert events.index(("end", "kernel.cpp")) < events.index(("start", "link"))


def test_a_partition_of_one_output_keeps_its_calling_convention_through_torchs_loader():
    """A graph returning one tensor (not a tuple) compiled from the graph itself loads through
    torch's own package loader too, which reads the recorded input and output specs."""
    import os
    import tempfile

    from torch._inductor.package import load_package

    from kiln.compiler.options import CompileOptions
    gm = torch.fx.symbolic_trace(_OneOut())
    x = torch.randn(3, 5)
    flat = inductor_lean.flat_graph(gm, (x,))
    assert flat is not None and flat.graph is not gm.graph
    assert isinstance(gm.graph.find_nodes(op="output")[0].args[0], torch.fx.Node)  # the partition's own output untouched
    blob = inductor.InductorEngine().compile(gm, (x,), CompileOptions())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.pt2")
        with open(path, "wb") as f:
            f.write(blob)
        loaded = load_package(path)
        assert_close(loaded(x), _OneOut()(x), **TOL)                        # one tensor back, as the graph returns
    assert_close(inductor.AotiRunner(blob, 1)([x])[0], _OneOut()(x), **TOL)
    assert inductor_lean.flat_graph(gm, (x, 3)) is None                         # a non-tensor input: exported first


class _OneOut(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x) * 2


def test_a_wrapper_build_that_fails_fails_the_compile_and_nothing_is_left_running(monkeypatch):
    """The wrapper's compile runs beside the kernels'; its error surfaces at the link, and a
    failing kernel build still waits for the wrapper's before the build directory goes."""
    import time
    from types import SimpleNamespace

    from torch._inductor.cpp_builder import CppBuilder

    monkeypatch.setattr(inductor_lean, "available_cpus", lambda: 2)
    log = []

    def fake_build(self):
        log.append(("start", self.name))
        time.sleep(0.2 if self.name == "wrapper" else 0)
        if self.name in self.fails:
            raise RuntimeError(f"{self.name} failed")
        log.append(("end", self.name))

    monkeypatch.setattr(CppBuilder, "build", fake_build)

    def builder(name, fails, **kw):
        return SimpleNamespace(name=name, fails=fails, _compile_only=name != "link", _do_link=name == "link",
                               _sources_args=f"/tmp/x.{name}.cpp" if name != "link" else "a.o b.o")

    with pytest.raises(RuntimeError, match="wrapper failed"):
        with inductor_lean.wrapper_beside_kernels():
            CppBuilder.build(builder("wrapper", {"wrapper"}))
            CppBuilder.build(builder("kernel", {"wrapper"}))
            CppBuilder.build(builder("link", {"wrapper"}))
    assert ("start", "link") not in log
    log.clear()
    with pytest.raises(RuntimeError, match="kernel failed"):
        with inductor_lean.wrapper_beside_kernels():
            CppBuilder.build(builder("wrapper", {"kernel"}))
            CppBuilder.build(builder("kernel", {"kernel"}))
    assert ("end", "wrapper") in log                 # waited for before the error left
    assert CppBuilder.build is fake_build            # put back
    CppBuilder.build(builder("wrapper", set()))      # outside kiln's compile: in this thread, at once
    assert log[-1] == ("end", "wrapper")
