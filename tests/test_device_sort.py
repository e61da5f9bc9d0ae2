"""A device program whose sort/topk indices index another tensor, compiled by Inductor: an
index those indices take out of range is eager's error, never the end of the process.

Inductor's C++ kernels checked such an index inside an OpenMP region, where the throw calls
``std::terminate`` (exit 134). The compile's own NaN probe made such values on purpose
(a NaN sorts last, past a narrower tensor), so the program below ended the process at its
first, good, step (kiln.engines.inductor_bounds)."""
import json

from tests.conftest import run_py

PROGRAM = r"""
import json, warnings
import torch
from kiln.device import metrics, modes

dev = modes.device()
modes.set_mode("lazy", background=False, engine="inductor", optlevel=1)
y = torch.randn(4, 3)

def f(x, y):
    top = torch.topk(x, 2, dim=1)[1]                    # a position of 5: gathered from 3 columns
    low = torch.argsort(x, dim=1)[:, 0]
    return y.gather(1, top), y[-1 - low]                # rows counted from the end

def step(x):
    a, b = f(x.to(dev), y.to(dev))
    modes.mark_step()
    return a.cpu(), b.cpu()

def outcome(fn, *args):
    try:
        return [t.tolist() for t in fn(*args)]
    except Exception as e:                              # noqa: BLE001 - the error is the answer
        return f"{type(e).__name__}: {e}"

good = torch.tensor([5., 4, 0, 1, 2]).repeat(4, 1)
bad = torch.tensor([5., 1, 2, 3, 4]).repeat(4, 1)       # topk picks position 4
metrics.clear()
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    got = [outcome(step, x) for x in (good, bad, good * 2)]
print(json.dumps({"device": got, "eager": [outcome(f, x, y) for x in (good, bad, good * 2)],
                  "compiles": metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile")}))
"""


def test_sort_indices_out_of_range_on_inductor_are_eagers_error_not_an_abort():
    r = run_py(PROGRAM, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]      # SIGABRT before: "index out of bounds: 0 <= tmp2 < 3L"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    device, eager = out["device"], out["eager"]
    assert eager[1] == "RuntimeError: index 4 is out of bounds for dimension 1 with size 3"
    assert device[1] == eager[1]                    # eager's own error, from the run op by op
    for got, expected in ((device[0], eager[0]), (device[2], eager[2])):
        assert got == expected                      # gathers and row picks: exact (atol=rtol=0)
    assert out["compiles"] == 1                     # compiled once, and still used after the error


SCATTER = r"""
import json, warnings
import torch
from kiln.device import metrics, modes

dev = modes.device()
modes.set_mode("lazy", background=False, engine="inductor", optlevel=2)

def f(x, y):
    v, i = torch.sort(x[:, 1:], dim=1, descending=True, stable=True)
    j = (i.float() * 0.5).floor().to(torch.int64)       # 0.5 is an input (a lifted scalar)
    return torch.take(y, j), y.clone().scatter_(1, j, v)

def step(x, y):
    a, b = f(x.to(dev), y.to(dev))
    modes.mark_step()
    return a.cpu(), b.cpu()

torch.manual_seed(0)
metrics.clear()
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    results = []
    for _ in range(3):
        x, y = torch.randn(6, 6), torch.randn(6, 6)
        results.append([bool(torch.equal(p, q)) for p, q in zip(step(x, y), f(x, y))])
print(json.dumps({"equal": results,
                  "compiles": metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile")}))
"""


def test_a_vector_kernels_scatter_at_a_computed_index_is_checked_where_the_index_is_made():
    """The compile's probe puts infinities in the lifted 0.5: ``floor(i * inf)`` cast to
    int64 indexes far outside ``y``. The original kernels ended the process at the check;
    zeroing the index after the vector kernel had copied its lanes out still wrote through
    the copy ("munmap_chunk(): invalid pointer", SIGABRT)."""
    r = run_py(SCATTER, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["equal"] == [[True, True]] * 3           # take and scatter: exact, as eager's
    assert out["compiles"] == 1
