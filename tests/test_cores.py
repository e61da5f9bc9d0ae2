"""kiln cores: CPU grouping, placement env vars, pinned workers, and the async API."""
import os
import threading

import pytest
import torch

import kiln
from kiln.host import cores as placement
from kiln.errors import InputError

from . import models
from .conftest import assert_close, run_py

CPUS = placement.process_cpus()
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


@pytest.fixture
def one_cpu_per_core(monkeypatch):
    for k in ("KILN_VISIBLE_CORES", "KILN_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KILN_CPUS_PER_CORE", "1")


@pytest.fixture(scope="module")
def mlp():
    model, x = models.mlp()
    return model, kiln.trace(model, x)


def test_parse_and_format_core_lists():
    assert placement.parse_list("0-2,5", "X") == [0, 1, 2, 5]
    assert placement.format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    with pytest.raises(placement.PlacementError, match="X='a-b'"):
        placement.parse_list("a-b", "X")


def test_cores_group_the_process_cpus(one_cpu_per_core, monkeypatch):
    cores = placement.visible()
    assert [c.cpus for c in cores] == [(c,) for c in CPUS]
    monkeypatch.setenv("KILN_CPUS_PER_CORE", str(len(CPUS)))
    assert [c.cpus for c in placement.visible()] == [tuple(CPUS)]
    for bad in ("abc", "0", "1.5"):     # "abc" raised a raw ValueError
        monkeypatch.setenv("KILN_CPUS_PER_CORE", bad)
        with pytest.raises(placement.PlacementError, match="KILN_CPUS_PER_CORE="):
            placement.visible()


@two_cpus
def test_visible_and_num_cores_env(one_cpu_per_core, monkeypatch):
    monkeypatch.setenv("KILN_VISIBLE_CORES", "1")
    (core,) = placement.visible()
    assert (core.id, core.host_index, core.cpus) == (0, 1, (CPUS[1],))   # renumbered from 0
    monkeypatch.setenv("KILN_VISIBLE_CORES", f"0-{len(CPUS)}")
    with pytest.raises(placement.PlacementError, match=f"names core\\(s\\) \\[{len(CPUS)}\\]"):
        placement.visible()
    monkeypatch.delenv("KILN_VISIBLE_CORES")
    monkeypatch.setenv("KILN_NUM_CORES", "1")
    assert [c.cpus for c in placement.visible()] == [(CPUS[0],)]
    monkeypatch.setenv("KILN_NUM_CORES", "99")
    with pytest.raises(placement.PlacementError, match="KILN_NUM_CORES=99"):
        placement.visible()


@two_cpus
def test_neuron_env_names_are_honoured_by_the_compat_layer(one_cpu_per_core, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1")
    monkeypatch.setattr(placement, "neuron_env", False)
    assert len(placement.visible()) == len(CPUS)          # plain kiln ignores Neuron's names
    monkeypatch.setattr(placement, "neuron_env", True)    # what honour_neuron_env() sets
    assert [c.host_index for c in placement.visible()] == [1]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")
    with pytest.raises(placement.PlacementError, match="NEURON_RT_VISIBLE_CORES=4-5 names core"):
        placement.visible()                               # the variable set is the one named
    monkeypatch.setenv("KILN_VISIBLE_CORES", "0")         # kiln's own name wins
    assert [c.host_index for c in placement.visible()] == [0]


@two_cpus
def test_importing_the_neuron_spellings_moves_no_model(mlp, tmp_path):
    """Neuron's core names apply inside kiln.neuron*/neuronx calls, not to a process that imports them."""
    path = tmp_path / "m.kiln"
    mlp[1].save(path)
    r = run_py(f"""
import torch, kiln, kiln.neuron, kiln.neuronx
from kiln.host import cores
plain = kiln.load({str(path)!r})
with cores.neuron_names():
    neuron = kiln.load({str(path)!r})
traced = kiln.neuronx.trace(torch.nn.Linear(4, 2), torch.randn(1, 4))
print(cores.neuron_env, plain.worker is None, sorted(neuron.worker.affinity()),
      sorted(traced.worker.affinity()))
""", env={"NEURON_RT_VISIBLE_CORES": "1", "KILN_CPUS_PER_CORE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", f"[{CPUS[1]}]", f"[{CPUS[1]}]"]


@two_cpus
def test_to_core_pins_the_worker_and_sizes_engine_threads(one_cpu_per_core, mlp):
    model, compiled = mlp
    m = kiln.load(compiled.to_bytes())
    assert m.core is None and m.worker is None
    m.to_core(1)
    assert m.core.cpus == (CPUS[1],)
    assert m.worker.affinity() == {CPUS[1]}
    seen = []
    runner, ins, order = m.program.direct                  # one partition fed directly
    m.program.direct = (_spy(runner, seen), ins, order)
    x = torch.randn(2, 16)
    assert_close(m(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert seen == [m.worker.native_id]                    # the engine ran on the pinned worker
    assert os.sched_getaffinity(0) == set(CPUS)            # the caller's own thread is untouched
    with pytest.raises(placement.PlacementError, match="no kiln core 7"):
        m.to_core(7)


def _spy(runner, seen):
    def run(inputs):
        seen.append(threading.get_native_id())
        return runner(inputs)
    return run


@two_cpus
def test_cores_context_places_models_loaded_inside(one_cpu_per_core, mlp):
    _, compiled = mlp
    with kiln.cores(1) as core:
        m = kiln.load(compiled.to_bytes())
    assert m.core == core and m.worker.affinity() == {CPUS[1]}
    outside = kiln.load(compiled.to_bytes())
    assert outside.core is None


@two_cpus
def test_visible_cores_env_pins_models_in_a_fresh_process(mlp, tmp_path):
    path = tmp_path / "m.kiln"
    mlp[1].save(path)
    r = run_py(f"""
import os, torch, kiln
m = kiln.load({str(path)!r})
print(sorted(m.worker.affinity()), m(torch.randn(2, 16)).shape)
""", env={"KILN_VISIBLE_CORES": "1", "KILN_CPUS_PER_CORE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == f"[{CPUS[1]}]"


def test_submit_futures_resolve_in_order(mlp):
    model, compiled = mlp
    xs = [torch.randn(2, 16) for _ in range(12)]
    order = []
    futures = []
    for i, x in enumerate(xs):
        f = compiled.submit(x)
        f.add_done_callback(lambda _, i=i: order.append(i))
        futures.append(f)
    for f, x in zip(futures, xs):
        assert_close(f.result(timeout=60), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert order == list(range(12))


def test_submit_reports_bad_inputs_on_the_future(mlp):
    _, compiled = mlp
    fut = compiled.submit(torch.randn(3, 16))
    with pytest.raises(InputError, match=r"expected \(2, 16\)"):
        fut.result(timeout=10)


def test_map_bounds_in_flight_work(mlp):
    model, compiled = mlp
    xs = [torch.randn(2, 16) for _ in range(9)]
    submitted = []
    real_submit = compiled.submit

    def counting(*a, **k):
        submitted.append(1)
        return real_submit(*a, **k)

    compiled.submit = counting
    try:
        results = compiled.map(iter(xs), max_in_flight=3)
        first = next(results)
        assert len(submitted) == 3                           # no more than 3 started ahead
        rest = list(results)
    finally:
        del compiled.submit
    for got, x in zip([first] + rest, xs):
        assert_close(got, model(x).detach(), atol=1e-5, rtol=1e-5)
    assert len(rest) == 8
