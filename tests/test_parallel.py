"""DataParallel: replicas in worker processes pinned to kiln cores."""
import os
import signal
import time

import pytest
import torch

import kiln
import kiln.neuronx
from kiln.host import cores as placement
from kiln.errors import InputError, KilnError, PlacementError
from kiln.errors import WorkerDiedError

from . import models
from .conftest import assert_close

CPUS = placement.process_cpus()
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module", autouse=True)
def one_cpu_per_core():
    old = {k: os.environ.pop(k, None) for k in ("KILN_VISIBLE_CORES", "KILN_NUM_CORES")}
    os.environ["KILN_CPUS_PER_CORE"] = "1"
    yield
    os.environ.pop("KILN_CPUS_PER_CORE")
    os.environ.update({k: v for k, v in old.items() if v is not None})


@pytest.fixture(scope="module")
def mlp():
    model, x = models.mlp()          # compiled at batch 2
    return model, kiln.trace(model, x)


@pytest.fixture(scope="module")
def dp(mlp):
    with kiln.DataParallel(mlp[1]) as parallel:
        yield parallel


def test_replicas_are_pinned_one_per_core(dp):
    assert dp.num_workers == 2
    assert [os.sched_getaffinity(pid) for pid in dp.worker_pids] == [{CPUS[0]}, {CPUS[1]}]
    assert "core 0" in repr(dp) and "core 1" in repr(dp)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 16])
def test_ragged_batches_equal_eager_in_order(dp, mlp, n):
    model, _ = mlp
    x = torch.randn(n, 16)
    assert_close(dp(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_futures_from_many_callers_match_their_inputs(dp, mlp):
    model, _ = mlp
    xs = [torch.randn(1 + i % 4, 16) for i in range(16)]
    futures = [dp.submit(x) for x in xs]
    for f, x in zip(futures, xs):
        assert_close(f.result(timeout=60), model(x).detach(), atol=1e-5, rtol=1e-5)
    results = list(dp.map(xs, max_in_flight=4))
    for got, x in zip(results, xs):
        assert_close(got, model(x).detach(), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_clear_errors(dp):
    with pytest.raises(InputError, match=r"only dim 0 may differ.*got \(4, 17\)"):
        dp(torch.randn(4, 17))
    assert dp.submit(torch.randn(4, 17)).exception(timeout=10) is not None


@pytest.mark.parametrize("settings, error, message", [
    (dict(device_ids=[]), PlacementError, r"device_ids=\[\] names no core.*such as \[0, 1\].*or None"),
    (dict(device_ids=1), PlacementError, r"device_ids=1 is not a list of kiln core numbers; pass e.g. \[0, 1\]"),
    (dict(set_dynamic_batching="no"), KilnError, r"set_dynamic_batching\) = 'no' \(str\): expected True or False"),
    (dict(split_size=0), KilnError, r"split_size=0 \(int\): expected a number of rows per chunk, 1 or more"),
    (dict(split_size=-2), KilnError, r"split_size=-2 \(int\): expected"),
    (dict(split_size=1.5), KilnError, r"split_size=1.5 \(float\): expected"),
    (dict(num_workers=0), PlacementError, r"num_workers=0: expected a number of replica processes, 1 or more"),
])
def test_wrong_settings_are_clear_errors_at_construction(mlp, monkeypatch, settings, error, message):
    """Found by probing: DataParallel(device_ids=[]) was built and its first call raised
    ZeroDivisionError; split_size=-2 or 1.5 raised torch.split's own error at the call, and
    split_size=0, num_workers=0 and set_dynamic_batching="no" were read as something else."""
    from kiln.runtime import replicas
    monkeypatch.setattr(replicas, "_Replica", None)       # none may start: refused before that
    with pytest.raises(error, match=message):
        kiln.neuronx.DataParallel(mlp[1], **settings)


def test_split_size_is_checked_when_set(dp, mlp):
    model, _ = mlp
    with pytest.raises(KilnError, match=r"split_size=0 \(int\): expected"):
        dp.split_size = 0
    assert dp.split_size is None
    dp.split_size = 3
    try:
        x = torch.randn(7, 16)
        assert_close(dp(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    finally:
        dp.split_size = None


def test_large_outputs_grow_the_shared_memory(dp, mlp):
    model, _ = mlp
    x = torch.randn(100_000, 16)          # 6.4 MB in, 1.6 MB out per replica: beyond 1 MiB
    assert_close(dp(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_without_dynamic_batching_chunks_are_the_compiled_size(mlp):
    model, compiled = mlp
    with kiln.neuronx.DataParallel(compiled, device_ids=[1], set_dynamic_batching=False) as dp:
        assert [os.sched_getaffinity(p) for p in dp.worker_pids] == [{CPUS[1]}]
        x = torch.randn(6, 16)
        assert_close(dp(x), model(x).detach(), atol=1e-5, rtol=1e-5)
        with pytest.raises(InputError, match="compiled batch size 2 along dim 0; got 5"):
            dp(torch.randn(5, 16))


def test_killed_worker_fails_its_call_and_is_restarted(mlp):
    model, compiled = mlp
    with kiln.DataParallel(compiled, device_ids=[0]) as dp:
        (old_pid,) = dp.worker_pids
        # rows in chunks of 2 keep the replica busy: the call must still be in flight after
        # half a second (60k rows took seconds on the CI machine; a faster one gets more)
        for rows in (60_000, 240_000, 960_000):
            fut = dp.submit(torch.randn(rows, 16))
            time.sleep(0.5)
            if not fut.done():
                break
        assert not fut.done(), "even 960k rows finished within half a second"
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"died with exit code -9 while running a call"):
            fut.result(timeout=120)
        x = torch.randn(3, 16)
        assert_close(dp(x), model(x).detach(), atol=1e-5, rtol=1e-5)   # restarted, serving
        assert dp.replicas[0].restarts == 1 and dp.worker_pids != [old_pid]


def test_close_stops_the_workers(mlp):
    dp = kiln.DataParallel(mlp[1], device_ids=[0])
    pids = dp.worker_pids
    dp.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(KilnError, match="closed"):
        dp(torch.randn(2, 16))


def test_rejects_what_it_cannot_run():
    with pytest.raises(KilnError, match="takes a kiln model"):
        kiln.DataParallel(torch.nn.Linear(2, 2))


def test_a_jit_loaded_model_a_shared_input_and_another_dim(tmp_path, caplog):
    """Neuron's serving pattern, DataParallel(torch.jit.load(path)), was refused; an input
    every row shares (a bias) was taken for a batch ("inputs disagree on the batch size");
    dim=2 with Neuron's default set_dynamic_batching=True raised where Neuron turns dynamic
    batching off. A split along dim 2 is refused: kiln.trace proves rows independent along dim 0."""
    from tests.test_neuron_compat import _Biased
    model, x, bias = _Biased().eval(), torch.randn(2, 16), torch.randn(4)
    torch.jit.save(kiln.neuronx.trace(model, (x, bias)), str(tmp_path / "m.pt"))
    with kiln.neuronx.DataParallel(torch.jit.load(str(tmp_path / "m.pt")), device_ids=[0]) as dp:
        five = torch.randn(5, 16)
        assert_close(dp(five, bias), model(five, bias).detach(), atol=1e-5, rtol=1e-5)
    plus_one = kiln.neuronx.trace(lambda t: t + 1, torch.rand(1, 3, 8, 8))
    with kiln.neuronx.DataParallel(plus_one, device_ids=[0, 1], dim=2) as dp:
        image = torch.rand(1, 3, 8, 8)
        assert_close(dp(image), image + 1, atol=0, rtol=0)     # the compiled size along dim 2: whole
        with pytest.raises(InputError, match="the trace-time proof is along dim 0, and DataParallel splits dim 2"):
            dp(torch.rand(1, 3, 16, 8))     # kiln.trace proves rows independent along dim 0 only
    assert "with dim=2 it is off" in caplog.text


def test_data_parallel_splits_a_model_of_row_pairs_into_even_chunks():
    """Found by review: a model eager runs at even row counts only (its trace-time check ran at a
    multiple of 2 rows) was split into a chunk per core of any size, so 2, 6, 10 and 14 rows on
    two cores were refused chunk by chunk ('a batch of 3 rows, but this model takes only
    multiples of 2 rows') though the model answers them; chunks are now multiples of 2."""
    from tests.test_dynamic_batch_rows import _PairScale
    model = _PairScale().eval()
    m = kiln.trace(model, torch.randn(4, 3), dynamic_batch=True)
    assert m.manifest["batch_check"]["row_multiple"] == 2
    with kiln.DataParallel(m, device_ids=[0, 1]) as dp:
        for n in (2, 6, 14):
            x = torch.randn(n, 3)
            torch.testing.assert_close(dp(x), model(x), atol=1e-5, rtol=1e-5)
        dp.split_size = 3
        with pytest.raises(kiln.errors.InputError, match="split_size=3, but this model takes only multiples of 2"):
            dp(torch.randn(6, 3))
