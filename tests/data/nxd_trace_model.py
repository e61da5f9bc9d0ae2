"""NxD's inference skeleton as a script, for tests/test_nxd_trace.py: a Column->Row MLP
built inside each rank (after its parallel state exists) from an unsharded checkpoint
(``parallel_layers.load(path, model, sharded=False)``; the path reaches the ranks in the
environment, which they inherit).

``python nxd_trace_model.py trace DIR``: write the checkpoint, parallel_model_trace at
tp 2, compare with the unsharded eager MLP, parallel_model_save to DIR/tp_models.
``python nxd_trace_model.py load DIR``: parallel_model_load and compare again (a fresh
process). Each writes DIR/<mode>.json with the largest differences it saw, and, after a
call with a wrong batch size (and, through the internal step that skips rank 0's input
check, one that fails on every rank), what was raised and the difference of a correct
call made afterwards.
"""
import json
import os
import sys

import torch

from kiln.neuronx_distributed.parallel_layers import ColumnParallelLinear, RowParallelLinear, load

HIDDEN, FFN = 32, 64


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = ColumnParallelLinear(HIDDEN, FFN, gather_output=False)
        self.down = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def reference(state_dict):
    """The same MLP unsharded, in plain torch."""
    up, down = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
    up.weight.data, up.bias.data = state_dict["up.weight"], state_dict["up.bias"]
    down.weight.data, down.bias.data = state_dict["down.weight"], state_dict["down.bias"]
    return lambda x: down(torch.relu(up(x)))


def get_model():
    model = MLP().eval()
    load(os.environ["NXD_TRACE_CKPT"], model, sharded=False)
    return model, {}


def _diff(model, ref, inputs):
    return max(float((model(x) - ref(x)).abs().max()) for x in inputs)


def _error(call):
    try:
        call()
    except Exception as e:                                  # noqa: BLE001  the test checks which
        return f"{type(e).__name__}: {e}"
    return None


def _bad_calls(tm, ref, inputs):
    """A wrong-shaped call, then one that reaches every rank and fails there: each is an
    error for that call only; a correct call afterwards still answers."""
    wrong = inputs[0][:1]
    return {"bad_call": _error(lambda: tm(wrong)),
            "ranks_fail": _error(lambda: tm._run_ranks((wrong,))),
            "diff_after_bad": _diff(tm, ref, inputs)}


if __name__ == "__main__":          # required: the trace starts processes that import this file
    import kiln.neuronx_distributed as nxd
    mode, workdir = sys.argv[1], sys.argv[2]
    ckpt = os.path.join(workdir, "full.pt")
    os.environ["NXD_TRACE_CKPT"] = ckpt
    torch.manual_seed(0)
    inputs = [torch.randn(2, 8, HIDDEN) for _ in range(3)]
    if mode == "trace":
        up, down = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
        sd = {"up.weight": up.weight.data, "up.bias": up.bias.data,
              "down.weight": down.weight.data, "down.bias": down.bias.data}
        torch.save({"model": sd}, ckpt)
    ref = reference(torch.load(ckpt)["model"])
    result = {}
    with torch.no_grad():
        if mode == "trace":
            tm = nxd.trace.parallel_model_trace(get_model, inputs[0], tp_degree=2)
            result.update(tp_degree=tm.tp_degree, diff=_diff(tm, ref, inputs))
            result.update(_bad_calls(tm, ref, inputs))
            nxd.trace.parallel_model_save(tm, os.path.join(workdir, "tp_models"))
            result["files"] = sorted(os.listdir(os.path.join(workdir, "tp_models")))
            tm.close()
        else:
            tm = nxd.trace.parallel_model_load(os.path.join(workdir, "tp_models"))
            result.update(tp_degree=tm.tp_degree, diff=_diff(tm, ref, inputs))
            result.update(_bad_calls(tm, ref, inputs))
            tm.close()
    with open(os.path.join(workdir, f"{mode}.json"), "w") as f:
        json.dump(result, f)
