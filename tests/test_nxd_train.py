"""NxD-style training (tests/data/nxd_train.py: a tiny Llama-like decoder of NxD's parallel
layers, parallel_cross_entropy, AdamW under NeuronZero1Optimizer with clipping,
save_checkpoint/load_checkpoint) under torchrun equals the same model trained in one
process at TP=1: TP=2 on kiln's device (lazy mode, the "xla" process group) and
DP=2 x TP=2 on CPU tensors over gloo (NXD_CPU_MODE=1, 4 processes). NxD initializes the
full weights on every rank and slices them, so one seed gives the same model at every
degree; each rank's final parameters are compared with its slice of the TP=1 ones.

Four launches: the device run (which also saves after step 2 and resumes from it in a
fresh model), the one-process reference (which also tries to load the TP=2 checkpoint:
a clear error naming both degrees), and the DP x TP run (which also loads ZeRO-1 optimizer
state into a plain optimizer and the other way round: clear errors).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from kiln.distributed.shard import create_local_weight
from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "data", "nxd_train.py")
STEPS = 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compile cache for the device run's two ranks (one compiles a program, the other
    loads it). Only these subprocesses use it."""
    return str(tmp_path_factory.mktemp("nxd-cache"))


def _launch(directory, nproc, *args, cpu, cache):
    out = directory / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_URL=cache,
               NEURON_CC_FLAGS="-O1")      # first engine that compiles correctly: shorter device compiles
    if cpu:
        env["NXD_CPU_MODE"] = "1"
    else:
        env.pop("NXD_CPU_MODE", None)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={nproc}", SCRIPT, *args,
                           "--steps", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    params = {r: torch.load(directory / f"params_tp{r}.pt", weights_only=True) for r in range(report["tp"])}
    return report, params


@pytest.fixture(scope="module")
def device_tp2(tmp_path_factory, cache):
    directory = tmp_path_factory.mktemp("tp2-device")
    ckpt = directory / "ckpt"
    report, params = _launch(directory, 2, "--tp", "2", "--save-at", "2", "--ckpt", str(ckpt), cpu=False,
                             cache=cache)
    return report, params, ckpt


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache, device_tp2):
    directory = tmp_path_factory.mktemp("tp1")
    return _launch(directory, 1, "--tp", "1", "--load-check", str(device_tp2[2]), cpu=True, cache=cache)


def _assert_equal_to_reference(report, params, reference):
    ref_report, ref_params = reference
    ref = ref_params[0]
    assert len(report["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(ref_report["losses"]),
                               rtol=1e-5, atol=1e-6)
    # the clipped norm: TP-sharded grads summed over TP, replicated ones counted once, DP shards summed
    torch.testing.assert_close(torch.tensor(report["grad_norms"]), torch.tensor(ref_report["grad_norms"]),
                               rtol=1e-5, atol=1e-6)
    assert max(ref_report["grad_norms"]) > 1.0, "the test should exercise clipping (max_grad_norm=1.0)"
    tp = report["tp"]
    for rank in range(tp):
        assert set(params[rank]) == set(ref)
        for name, full in ref.items():
            dim, stride = report["partition"].get(name, (None, 1))
            want = full if dim is None else create_local_weight(full, dim, full.shape[dim] // tp, stride,
                                                                tp_rank=rank, tp_size=tp)
            torch.testing.assert_close(params[rank][name], want, rtol=1e-4, atol=2e-5,
                                       msg=lambda m: f"tp rank {rank} {name}: {m}")


def test_tp2_on_the_device_equals_one_process(device_tp2, reference):
    report, params, _ = device_tp2
    assert (report["tp"], report["dp"]) == (2, 1)
    _assert_equal_to_reference(report, params, reference)
    # each TP rank holds half of the sharded weights' optimizer state (norm weights are replicated)
    assert report["optimizer_state_bytes"] < 0.52 * reference[0]["optimizer_state_bytes"]


def test_tp2_checkpoint_layout_and_resume(device_tp2):
    report, _, ckpt = device_tp2
    tag = ckpt / "step_2"
    names = sorted(str(p.relative_to(tag)) for p in tag.rglob("*") if p.is_file())
    assert names == ["checkpoint", "done",
                     "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                     "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_00_tp_rank_01_pp_rank_00.pt",
                     "user_content.pt"]
    assert (tag / "done").read_text() == "1"
    assert report["resumed_from"] == 2
    # a fresh model and optimizer loaded from step 2 train on to the same losses
    torch.testing.assert_close(torch.tensor(report["resumed"]), torch.tensor(report["losses"][2:]),
                               rtol=1e-6, atol=1e-7)


def test_loading_a_tp2_checkpoint_at_tp1_is_a_clear_error(reference):
    error = reference[0]["load_error"]
    assert error is not None and error.startswith("CheckpointError")
    assert "TP=2" in error and "TP=1" in error and "does not reshard" in error


@pytest.fixture(scope="module")
def cpu_dp2_tp2(tmp_path_factory, cache):
    directory = tmp_path_factory.mktemp("dp2-tp2-cpu")
    return _launch(directory, 4, "--tp", "2", "--kind-check", str(directory / "kinds"), cpu=True, cache=cache)


def test_dp2_x_tp2_on_cpu_equals_one_process(cpu_dp2_tp2, reference):
    report, params = cpu_dp2_tp2
    assert (report["tp"], report["dp"]) == (2, 2)
    _assert_equal_to_reference(report, params, reference)
    # TP halves the optimizer state and ZeRO-1 halves it again (plus dim-0 padding to DP)
    assert report["optimizer_state_bytes"] < 0.27 * reference[0]["optimizer_state_bytes"]


def test_optimizer_state_of_the_other_zero1_kind_is_a_clear_error(cpu_dp2_tp2):
    """At DP=2 x TP=2: ZeRO-1 state into a plain AdamW (torch's load_state_dict took it and
    kept no state at all) and plain state into a ZeRO-1 optimizer (the error blamed the DP
    degree: without ZeRO-1 only DP rank 0 writes optim/) each name the optimizer kinds."""
    errors = cpu_dp2_tp2[0]["kind_errors"]
    into_plain, into_zero1 = errors["zero1_into_plain"], errors["plain_into_zero1"]
    assert into_plain is not None and into_plain.startswith("CheckpointError"), errors
    assert "saved with ZeRO-1" in into_plain and "is not ZeRO-1" in into_plain, errors
    assert into_zero1 is not None and into_zero1.startswith("CheckpointError"), errors
    assert "saved without ZeRO-1" in into_zero1 and "DP=" not in into_zero1, errors
    # rank 0's files are good, TP rank 1's model file is damaged: rank 0 raises too, naming it
    damaged = errors["damaged"]
    assert damaged is not None and damaged.startswith("CheckpointError: rank 1 could not load its checkpoint"), errors
    assert "is damaged or not a torch.save file" in damaged and "add_safe_globals" not in damaged, errors
