"""Data parallelism on kiln's device over 2 processes (loopback, the "xla" backend: gloo
over host memory): DDP and FSDP2 (``fully_shard``) under torchrun, gradients clipped by
``clip_grad_norm_``, and torch_xla's ``xmp.spawn`` + ``xm.optimizer_step`` with no process
group of the script's own (through ``kiln run-xla``), all equal single-process training on
the same global batch. The same launches check the collectives on their own: the functional
ones (``torch.distributed._functional_collectives``), torch_xla's (``xm.all_reduce``,
``reduce_scatter``, ``all_to_all``), and what is refused (FSDP1, ``torch_xla.distributed.fsdp``)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tests.conftest import ROOT, run_py

SCRIPT = os.path.join(ROOT, "tests", "data", "ddp_train.py")
SPAWN_SCRIPT = os.path.join(ROOT, "tests", "data", "xla_spawn_train.py")


def _single_process(clip=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    losses, norms = [], []
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss))
    return losses, norms, model.state_dict()


def _values(line_start: str, stdout: str):
    return next(ln for ln in stdout.splitlines() if ln.startswith(line_start + " "))[len(line_start) + 1:]


def _close(got, expected):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def _check_functional_collectives(checks):
    """ddp_train.py's functional collectives on the device (lazy mode), each result used
    after: what the CPU computes from the two ranks' inputs. They failed at that use
    ("Attempted to access the data pointer on an invalid python storage"), and so did
    clip_grad_norm_ on FSDP2's gradients (DTensor's all-reduce)."""
    t = [torch.tensor([1.0, 2.0]) * (r + 1) for r in (0, 1)]
    for rank, got in enumerate(checks):
        f = got["funcol"]
        _close(f["all_reduce"], ((t[0] + t[1]) ** 0.5).tolist())
        _close(f["all_gather"], (torch.cat(t) * 2).tolist())
        _close(f["reduce_scatter"], ((torch.arange(4.0) * 2 + 1).chunk(2)[rank] + 1).tolist())
        _close(f["raw"], (torch.maximum(*t) - 1).tolist())


def _check_fsdp1_refused(checks):
    """FSDP1 on the device: an error at construction that names FSDP2 (it crashed in its
    sharding: "Trying to resize storage that is not resizable")."""
    for got in checks:
        assert got["fsdp1"].startswith("NotImplementedError: kiln: FSDP1"), got["fsdp1"]
        assert "fully_shard" in got["fsdp1"], got["fsdp1"]


def _check_xm_collectives(checks):
    """xla_spawn_train.py's torch_xla collectives against what torch_xla gives, computed on
    the CPU from each rank's inputs."""
    world = len(checks)
    for rank, got in enumerate(checks):
        # a single tensor: a new tensor, outside autograd; the input and its gradients
        # unchanged (the input used to become the mean, its gradients scaled by 1/world)
        y, mean, same, requires_grad, grad = got["single"]
        assert (same, requires_grad) == (False, False)
        _close([y, mean], [3.0 * (rank + 1), sum(3.0 * (r + 1) for r in range(world)) / world])
        _close(grad, [float(rank + 1)] * 2)
        # a list: in place, the list itself returned; scale after the reduction
        same, a, b = got["list"]
        assert same is True
        _close(a, (torch.stack([torch.tensor([1.0, -2.0 * r]) for r in range(world)]).amax(0) * 2).tolist())
        _close(b, [2.0 * (3.0 + world - 1)])
        xs = [torch.arange(8.0).reshape(2, 4) + 10 * r for r in range(world)]
        _close(got["reduce_scatter"], (sum(xs) * 0.5).chunk(world, 1)[rank].tolist())
        into, highest, lowest = got["reduce_scatter_list"]
        assert into is True
        _close(highest, torch.stack(xs).amax(0).chunk(world, 0)[rank].tolist())
        _close(lowest, torch.stack([-x for x in xs]).amax(0).chunk(world, 0)[rank].tolist())
        vs = [torch.arange(8.0).reshape(4, 2) + 100 * r for r in range(world)]
        _close(got["all_to_all"], torch.cat([v.chunk(world, 0)[rank] for v in vs], 1).tolist())
        assert got["fsdp"].startswith("torch_xla.distributed.fsdp") and "fully_shard" in got["fsdp"], got["fsdp"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compile cache for the three runs' ranks: the two ranks of a run compile the same
    programs (one compiles, the other loads), and the runs share the programs they have in
    common. Only these subprocesses use it."""
    return str(tmp_path_factory.mktemp("device-cache"))


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "xm-spawn"])
def test_two_processes_equal_one(kind, tmp_path, cache, kiln_cli):
    out = tmp_path / "params.pt"
    if kind == "xm-spawn":      # torch_xla's launcher, the script unchanged (its imports are torch_xla's)
        command = [kiln_cli, "run-xla", SPAWN_SCRIPT, str(out)]
    else:
        command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node=2",
                   SCRIPT, kind, str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_URL=cache))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("losses "))
    got = [float(v) for v in line.split()[1:]]
    # every step ran a compiled program, compiled in-line (not in the background: the two
    # ranks must switch to it at the same step, kiln.device.programs.in_background)
    compiled, background, interpreted = map(int, next(ln for ln in proc.stdout.splitlines()
                                                      if ln.startswith("compiles ")).split()[1:])
    assert compiled >= 1 and background == 0 and interpreted == 0, (compiled, background, interpreted)
    if kind == "xm-spawn":      # xm.all_gather over the two ranks (mesh_reduce gave the losses)
        assert "collectives [[0.0, 10.0], [1.0, 11.0]] 0.5 2" in proc.stdout, proc.stdout[-2000:]
        assert "has been compiled for" not in proc.stderr     # xm's gradient scaling: no program per shape
    if kind == "xm-spawn":
        _check_xm_collectives(json.loads(_values("xm_checks", proc.stdout)))
        expected, _, state = _single_process()
    else:
        checks = json.loads(_values("checks", proc.stdout))
        _check_functional_collectives(checks)
        _check_fsdp1_refused(checks)
        expected, norms, state = _single_process(clip=0.5)
        assert min(norms) > 0.5         # the clipping clips
        got_norms = [float(v) for v in _values("norms", proc.stdout).split()]
        torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    params = torch.load(out, weights_only=True)
    for key, value in state.items():
        torch.testing.assert_close(params[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_a_script_that_lets_pytorch_choose_the_backend(tmp_path):
    """``dist.init_process_group()`` with no backend takes the one PyTorch's table names for
    the accelerator, and kiln's device is the accelerator wherever kiln is installed: a
    CPU-only torchrun script (kiln never imported) failed at that line ("we don't know
    which communication backend to use"). It now gets gloo for CPU tensors and kiln's group
    for the device's (kiln.device.default_backend): the all-reduce sums and DDP averages
    the ranks' gradients, on the CPU and then on the device, in one group."""
    import json
    script = os.path.join(ROOT, "tests", "data", "default_backend.py")
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node=2",
               script, str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{n}.json").read_text()) for n in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["backend"] == "cpu:gloo,kiln:kiln"
        for where in ("cpu", "kiln"):
            assert r[where]["on"] == where
            assert r[where]["sum"] == [0.0, 3.0, 6.0]
            assert r[where]["funcol"] == [1.0, 13.0, 25.0]     # a functional all-reduce, used after (eager mode)
            assert r[where]["grad"] == [[1.5, 1.5, 1.5], [1.5, 1.5, 1.5]]     # inputs 1 and 2, averaged


def test_a_cpu_fsdp2_script_stays_on_the_cpu():
    """``fully_shard`` without a mesh takes PyTorch's accelerator, and kiln's device is one
    wherever kiln is installed: a CPU-only FSDP2 script over gloo had its parameters moved
    onto the device and failed at once ("incompatible tensor type"). Over a group with no
    backend for the device, the default mesh is now the CPU (kiln.device.fsdp_mesh)."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        ref.load_state_dict(m.state_dict())
        fully_shard(m)
        x = torch.randn(4, 8)
        out = m(x)
        out.sum().backward()
        ref(x).sum().backward()
        assert torch.accelerator.current_accelerator().type == "kiln"
        print(next(m.parameters()).device.type, (out - ref(x)).abs().max().item(),
              max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(m.parameters(), ref.parameters())))
        dist.destroy_process_group()
    """)
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    device, out_diff, grad_diff = proc.stdout.split()
    assert device == "cpu" and float(out_diff) == 0.0 and float(grad_diff) <= 1e-6
