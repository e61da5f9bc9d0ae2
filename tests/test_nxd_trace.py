"""NxD's parallel_model_trace / parallel_model_save / parallel_model_load at tp 2.

The script (tests/data/nxd_trace_model.py, NxD's inference skeleton) runs as __main__ in a
subprocess, so its module-level get_model reaches the child rank through the script's file,
as a user's script does. Save/load is checked in a second, fresh process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from kiln.errors import CompilerArgsError, InputError

SCRIPT = os.path.join(os.path.dirname(__file__), "data", "nxd_trace_model.py")
# float32 sums split over two ranks round differently from one matmul: not bit-equal
ATOL = 1e-5


def _run(mode, workdir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, SCRIPT, mode, str(workdir)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, f"{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    with open(os.path.join(workdir, f"{mode}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script's trace run, then its load run in a fresh process (one launch each, shared)."""
    workdir = tmp_path_factory.mktemp("nxd-trace")
    traced = _run("trace", workdir)
    return traced, _run("load", workdir)


def test_trace_tp2_equals_eager_and_save_load_round_trip(runs):
    traced, loaded = runs
    assert traced["tp_degree"] == 2
    assert traced["diff"] <= ATOL, traced
    assert traced["files"] == ["tp_0.pt", "tp_1.pt"]
    assert loaded["tp_degree"] == 2          # a fresh process: only the saved files
    assert loaded["diff"] <= ATOL, loaded


def _assert_bad_calls_leave_it_working(result):
    # rank 0 checks the inputs before the other ranks hear of the call: the kiln InputError
    assert result["bad_call"].startswith("InputError: input 'x': expected (2, 8, 32)"), result
    assert "(1, 8, 32)" in result["bad_call"]
    # a call that fails on every rank: each rank's error, for that call, and the ranks serve on
    assert result["ranks_fail"].startswith("NxDTraceError"), result
    assert "rank 1" in result["ranks_fail"] and "InputError" in result["ranks_fail"], result
    assert "gone" not in result["ranks_fail"], result
    assert result["diff_after_bad"] <= ATOL, result


def test_a_bad_call_is_an_error_for_that_call_only(runs):
    """After a wrong-shaped call the traced model (and the same model loaded from its saved
    files in a fresh process) still answers correct calls, and parallel_model_save works
    (the trace run saves after its bad calls)."""
    traced, loaded = runs
    _assert_bad_calls_leave_it_working(traced)
    assert traced["files"] == ["tp_0.pt", "tp_1.pt"]
    _assert_bad_calls_leave_it_working(loaded)


def _module_level():
    return torch.nn.Linear(2, 2), {}


@pytest.mark.parametrize("option, value", [
    ("spmd_mode", True), ("bucket_config", {}), ("states", {}), ("serialization_path", "x"),
    ("checkpoint_loader_callable", dict), ("inline_weights_to_neff", False),
    ("force_custom_init_on_device", True), ("max_parallel_compilations", 1)])
def test_unsupported_options_are_named(option, value):
    from kiln.neuronx_distributed.trace import parallel_model_trace
    with pytest.raises(CompilerArgsError, match=option):
        parallel_model_trace(_module_level, torch.randn(1, 2), tp_degree=2, **{option: value})


def test_bad_func_and_arguments_are_clear_errors(tmp_path):
    from kiln.neuronx_distributed import trace
    with pytest.raises(InputError, match="module-level"):
        trace.parallel_model_trace(lambda: (torch.nn.Linear(2, 2), {}), torch.randn(1, 2), tp_degree=2)
    with pytest.raises(TypeError, match="bogus"):
        trace.parallel_model_trace(_module_level, torch.randn(1, 2), bogus=1)
    with pytest.raises(CompilerArgsError, match="tp_degree"):
        trace.parallel_model_trace(_module_level, torch.randn(1, 2), tp_degree=0)
    with pytest.raises(InputError, match="tp_0.pt"):
        trace.parallel_model_load(str(tmp_path))
    with pytest.raises(InputError, match="TensorParallelNeuronModel"):
        trace.parallel_model_save(torch.nn.Linear(2, 2), str(tmp_path))
