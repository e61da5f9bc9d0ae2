"""``torch.compile(backend="kiln")`` answers what eager answers where it once did not: a
graph that fails to compile draws eager's random numbers, outputs that alias each other
alias as in eager, bf16 layer norm compiles, bad option values are clear errors."""
import warnings

import pytest
import torch
import torch.nn as nn

from kiln.device import metrics

OPTIONS = {"optlevel": 1}


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    metrics.clear()
    yield
    torch._dynamo.reset()


def _no_compile(monkeypatch):
    """Every kiln compile fails: each graph runs eagerly (with a warning)."""
    from kiln.device import graphs
    from kiln.errors import KilnError

    def refuse(*args, **kwargs):
        raise KilnError("refused by the test")
    monkeypatch.setattr(graphs, "trace", refuse)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_a_graph_that_fails_to_compile_draws_eagers_random_numbers(autocast, monkeypatch):
    """The failed compile's check whether eager fails on the values ran the graph, drawing
    its dropout masks, and the eager run drew again: the first call answered other masks
    than eager's (by up to 2.55) and left the generator elsewhere."""
    _no_compile(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Dropout(0.5), nn.Linear(32, 8)).train()
    compiled = torch.compile(model, backend="kiln", options=OPTIONS, dynamic=False)
    x = torch.randn(8, 16)

    def call(run):
        torch.manual_seed(123)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = run(x)
        return out, torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            want, want_state = call(model)
            got, got_state = call(compiled)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.equal(got_state, want_state)
    assert metrics.counter_value("EagerGraphs") >= 1
