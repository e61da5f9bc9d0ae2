"""Where the ranks run (kiln.distributed.launch) and the same-host all-reduce (kiln.distributed.shm).

Three process launches in all (each costs a torch import per rank): one ``torchrun --standalone
--nproc_per_node=2`` of this file (init_from_env pins the ranks to distinct cores, binds
"world", and the shared-memory all-reduce equals gloo's for sum/max over several shapes and
dtypes), and one driver process that is rank 0 of four ``start_ranks`` worlds in turn (an entry
run on 2 ranks; a child killed in the middle of a collective, with shared memory and with gloo;
a child that cannot start). Oversubscription is refused before anything starts, in-process.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))   # not from conftest: the ranks import this file


def _env(**extra):
    path = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {k: v for k, v in os.environ.items()
           if k not in ("KILN_VISIBLE_CORES", "KILN_NUM_CORES", "KILN_DIST_SHM")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)


def _results(stdout):
    return [json.loads(ln[len("RESULT "):]) for ln in stdout.splitlines() if ln.startswith("RESULT ")]


def _two_cores():
    from kiln.host import cores
    if len(cores.visible()) < 2:
        pytest.skip("needs 2 kiln cores (one per rank)")


# -- under torchrun --------------------------------------------------------------------------------
def test_torchrun_ranks_pinned_and_shm_equals_gloo():
    _two_cores()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", HERE, "torchrun"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=_env(KILN_DIST_SHM="on"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (res,) = _results(proc.stdout)
    a, b = res["affinity"]
    assert a and b and not set(a) & set(b), res["affinity"]
    assert res["cpus"] == res["affinity"] and res["threads"] == [len(a), len(b)]
    assert res["world"] == "TorchGroup(rank 0 of 2, ranks [0, 1])" and res["again_same"]
    assert res["backend"] == "gloo" and res["shm"] and res["backend_shm"]
    assert res["checked"] >= 50 and res["mismatches"] == [], res["mismatches"]


def _torchrun_rank():
    import torch.distributed as dist

    from kiln.distributed import groups, launch
    info = launch.init_from_env()
    again = launch.init_from_env()
    world = groups.get("world")
    per_rank = [None, None]
    dist.all_gather_object(per_rank, (sorted(os.sched_getaffinity(0)), list(info.cpus),
                                      torch.get_num_threads()))
    world.all_reduce(torch.zeros(1))          # chooses the path (KILN_DIST_SHM=on: shared memory)
    checked, bad = 0, []
    g = torch.Generator().manual_seed(10 + info.rank)
    shapes = [(), (1, 1, 576), (8, 1, 576), (3, 5, 7), (300_000,), (0, 4)]  # 300k fp32 > one slot
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for shape in shapes:
            x = (torch.randn(shape, generator=g) * 100).to(dtype)
            for op, red in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                ours = world.all_reduce(x, op)
                ref = x.clone()
                dist.all_reduce(ref, op=red)
                checked += 1
                if not torch.equal(ours, ref) or ours.shape != x.shape or ours.dtype != x.dtype:
                    bad.append(f"{dtype} {shape} {op}")
    # the same through dist.all_reduce on a "kiln_shm" group (the backend init_from_env registers)
    g_shm = dist.new_group(backend="kiln_shm")
    for shape in ((1, 1, 576), (300_000,)):
        for red in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            x = torch.randn(shape, generator=g)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours, op=red, group=g_shm)
            dist.all_reduce(ref, op=red)
            checked += 1
            if not torch.equal(ours, ref):
                bad.append(f"kiln_shm {shape} {red}")
    backend_shm = g_shm.fast is not None
    dist.destroy_process_group(g_shm)
    if info.rank == 0:
        res = {"backend_shm": backend_shm, "affinity": [p[0] for p in per_rank], "cpus": [p[1] for p in per_rank],
               "threads": [p[2] for p in per_rank], "world": repr(world), "again_same": again is info,
               "backend": info.backend, "shm": world.fast is not None, "checked": checked,
               "mismatches": bad}
        print("RESULT " + json.dumps(res), flush=True)
    world.close()
    dist.destroy_process_group()


# -- start_ranks: entries run in the children --------------------------------------------------------
def entry_sum(info, payload):
    """Both ranks: all-reduce, check, and report where each ran (rank 0 returns it)."""
    import torch.distributed as dist

    from kiln.distributed import groups
    world = groups.get("world")
    y = world.all_reduce(torch.full((4, 576), float(info.rank + 1) * payload["scale"]))
    if not torch.equal(y, torch.full((4, 576), 3.0 * payload["scale"])):
        raise AssertionError(f"rank {info.rank}: wrong all-reduce {y.flatten()[:4]}")
    where = [None, None]
    dist.all_gather_object(where, (sorted(os.sched_getaffinity(0)), torch.get_num_threads(),
                                   world.choice))
    return where


def entry_die_mid(info, payload):
    """Rank 1 dies (SIGKILL) while rank 0 waits in the second all-reduce."""
    from kiln.distributed import groups
    world = groups.get("world")
    world.all_reduce(torch.ones(576))
    if info.rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    world.all_reduce(torch.ones(576))


def _driver():
    from kiln.distributed import launch
    out = {}
    before = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    failures = []
    with launch.start_ranks(2, "tests.test_dist_launch:entry_sum", {"scale": 3.0},
                            on_failure=lambda *a: failures.append(a)) as ranks:
        where = ranks.call_entry()
        out["run"] = {"where": where, "codes": ranks.wait(120), "failures": failures}
    out["run"]["restored"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads()) == before
    for mode in ("on", "off"):
        os.environ["KILN_DIST_SHM"] = mode
        failures = []
        ranks = launch.start_ranks(2, "tests.test_dist_launch:entry_die_mid", collective_timeout=600,
                                   on_failure=lambda *a: failures.append(a[:2]))
        t0 = time.monotonic()
        try:
            ranks.call_entry()
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        deadline = time.monotonic() + 30       # the watchdog reports (at once; this is slack)
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        out[f"die-{mode}"] = {"error": error, "seconds": round(took, 2), "failures": failures,
                              "alive": ranks.alive(), "shm": _shm_used()}
        ranks.terminate()
    # a child whose entry does not exist there (different code on its path) fails to start
    sys.modules["tests.test_dist_launch"].only_in_rank0 = entry_sum
    try:
        launch.start_ranks(2, "tests.test_dist_launch:only_in_rank0", timeout=120)
        out["start"] = "started?"
    except launch.RankStartError as e:
        out["start"] = str(e)
    out["children_left"] = [pid for pid in _children_of(os.getpid())]
    # last: rank 0 dies without a word; its child must not outlive it (the test watches the pid)
    ranks = launch.start_ranks(2, "tests.test_dist_launch:entry_sleep")
    out["orphan"] = ranks.pids[1]
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def entry_sleep(info, payload):
    if info.rank:
        time.sleep(600)


def _children_of(pid):
    """Processes (zombies included) whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry))
    return found


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _shm_used():
    from kiln.distributed import groups
    return groups.get("world").fast is not None


def test_start_ranks_run_failures_and_dead_peers():
    _two_cores()
    proc = subprocess.run([sys.executable, "-c", "import tests.test_dist_launch as t; t._driver()"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (res,) = _results(proc.stdout)
    run = res["run"]
    (aff0, threads0, choice), (aff1, threads1, _) = run["where"]
    assert aff0 and aff1 and not set(aff0) & set(aff1) and threads0 == len(aff0) and threads1 == len(aff1)
    assert choice.startswith("probe:"), choice          # KILN_DIST_SHM=auto measured the paths
    assert run["codes"] == {"1": 0} and run["failures"] == [] and run["restored"]
    for mode, shm in (("on", True), ("off", False)):
        died = res[f"die-{mode}"]
        assert died["error"] is not None, died        # an error, not a hang (the subprocess timeout)
        if shm:
            assert "CollectiveError" in died["error"] and "rank 1" in died["error"], died
        assert died["shm"] is shm and died["failures"] == [[1, -signal.SIGKILL]], died
        assert died["alive"] is False
    assert "rank 1" in res["start"] and "exited with code 1" in res["start"], res["start"]
    assert "has no only_in_rank0" in res["start"], res["start"]   # the child's traceback tail
    assert res["children_left"] == []                              # terminate reaped every child
    deadline = time.monotonic() + 60
    while not _gone(res["orphan"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(res["orphan"]), f"rank 1 (pid {res['orphan']}) outlived rank 0"


# -- refused before anything starts ---------------------------------------------------------------------
def test_more_ranks_than_cores_is_a_placement_error(monkeypatch):
    from kiln.distributed import launch
    from kiln.errors import PlacementError
    from kiln.host import cores
    n = min(2, len(cores.visible()))
    monkeypatch.setenv("KILN_NUM_CORES", str(n))
    with pytest.raises(PlacementError, match=rf"{n + 1} ranks/workers need at least {n + 1} kiln cores, "
                                             rf"but only {n} are available"):
        launch.start_ranks(n + 1, "tests.test_dist_launch:entry_sum")
    for k, v in {"RANK": "0", "WORLD_SIZE": str(n + 1), "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": str(n + 1)}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(PlacementError, match="KILN_VISIBLE_CORES"):
        launch.init_from_env()
    assert cores.share(0, 1) == cores.visible()[:n]
    if n == 2:
        assert [cores.share(i, 2) for i in range(2)] == [[c] for c in cores.visible()]


if __name__ == "__main__" and sys.argv[1:] == ["torchrun"]:
    _torchrun_rank()
