"""``torch.compile(backend="kiln")`` answers what eager answers where it once did not: a
graph that fails to compile draws eager's random numbers, outputs that alias each other
alias as in eager, bf16 layer norm compiles, bad option values are clear errors."""
import warnings

import pytest
import torch
import torch.nn as nn

from kiln.device import metrics
from tests.test_device_compile import OPTIONS, _fresh

_AUTOUSE = (_fresh,)        # test_device_compile's autouse fixture, here too: dynamo reset around each test


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


def test_bf16_layer_norm_with_fp32_parameters_compiles_and_follows_eager(monkeypatch):
    """Layer norm of a bf16 linear output with fp32 weight: CPU's kernel saves fp32 mean
    and 1/std where PyTorch's dtype rules say bf16, so the check against eager refused the
    forward graph on Inductor ("output 3 has dtype bfloat16, eager float32") and it ran
    uncompiled. The graphs' metadata now says what CPU computes (checked by running them;
    Inductor's C++ build takes tens of seconds), and the model compiles on ONNX Runtime."""
    import copy

    from kiln.device import graphs
    seen, compile_graph = [], graphs.compile_graph

    def recording(gm, inputs, **kwargs):
        run = compile_graph(gm, inputs, **kwargs)

        def call(*args):
            if not any(isinstance(a, torch._subclasses.FakeTensor) for a in args):
                seen.append((gm, [a.detach() if isinstance(a, torch.Tensor) else a for a in args]))
            return run(*args)
        call.compiled = None
        return call
    monkeypatch.setattr(graphs, "compile_graph", recording)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="kiln", options={**OPTIONS, "engine": "onnxruntime"}, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(8, 10)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want, got = ref(x), compiled(x)
            assert got.dtype == want.dtype == torch.bfloat16
            # bf16 keeps 8 bits of mantissa: two orders of summation differ by an ulp or two
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
            want.float().pow(2).mean().backward()
            got.float().pow(2).mean().backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert p.grad.dtype == q.grad.dtype
                torch.testing.assert_close(p.grad, q.grad, rtol=2 ** -6, atol=1e-2)
    eager = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    assert not eager, eager
    assert metrics.counter_value("EagerGraphs") == 0
    assert len(seen) >= 2                          # the forward and the backward graph
    for gm, args in seen:
        said = [n.meta["val"].dtype for n in next(n for n in gm.graph.nodes if n.op == "output").args[0]
                if isinstance(n, torch.fx.Node)]
        assert [o.dtype for o in gm(*args) if o is not None] == said


def test_a_cat_onto_an_empty_tensor_before_a_view_compiles_on_inductor():
    """A key concatenated onto an empty cache, transposed and expanded for a batched matmul
    (a Hugging Face attention's first call): Inductor's decomposition of the ``cat`` keeps the
    key's transposed layout, and the view traced against ``cat``'s contiguous output was
    refused ("Cannot view a tensor ... strides (224, 16, 1, 32)"), so tiny GPT-2 under bf16
    autocast ran uncompiled."""
    def attention_scores(q, k):
        cache = torch.zeros(2, 2, 0, 16)
        keys = torch.cat([cache, k.transpose(1, 2)], dim=-2)
        return q @ (keys.transpose(-2, -1) * 0.25)
    q, k = torch.randn(2, 2, 7, 16), torch.randn(2, 7, 2, 16)
    compiled = torch.compile(attention_scores, backend="kiln", options={**OPTIONS, "engine": "inductor"},
                             dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(q, k)
    eager = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    assert not eager, eager
    torch.testing.assert_close(got, attention_scores(q, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, match", [({"optlevel": 7}, "optlevel=7.*1, 2 or 3"),
                                            ({"engine": "nonexistent_engine"}, "unknown engine 'nonexistent_engine'"),
                                            ({"quantize": "int3"}, "quantize='int3'")])
def test_bad_option_values_are_clear_errors_before_anything_runs_eagerly(options, match):
    """A value kiln refuses gave each graph a warning and ran every graph eagerly."""
    from torch._dynamo.exc import BackendCompilerFailed

    from kiln.device.compile_backend import checked_options
    from kiln.errors import CompilerArgsError
    with pytest.raises(CompilerArgsError, match=match):
        checked_options(options, None)
    model = nn.Linear(4, 2)
    with pytest.raises(BackendCompilerFailed, match=match):
        torch.compile(model, backend="kiln", options=options)(torch.randn(3, 4))
    assert metrics.counter_value("EagerGraphs") == 0


def _view_of_output(x):
    y = x * 2
    return y, y.view(2, -1)


def _two_views_of_a_hidden_value(x):
    y = x + 1
    return y.t(), y.view(-1)


def _slice_and_parts(x):
    y = x.t() * 3            # laid out transposed, as its input: kiln's output is contiguous
    return y, y[1:], *y.split(2)


@pytest.mark.parametrize("f", [_view_of_output, _two_views_of_a_hidden_value, _slice_and_parts],
                         ids=lambda f: f.__name__.strip("_"))
def test_outputs_that_are_views_of_one_another_alias_as_in_eager(f):
    """eager's ``y, y.view(2, -1)`` share storage (writing one changes the other);
    kiln's compiled graph returned a fresh tensor per output."""
    compiled = torch.compile(f, backend="kiln", options=OPTIONS, dynamic=False)
    x = torch.randn(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, want = compiled(x), f(x)
    assert not [w for w in caught if "runs eagerly" in str(w.message)]
    assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") >= 1
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
    torch.testing.assert_close(list(got), list(want), rtol=0, atol=0)
    got[0].fill_(5)
    want[0].fill_(5)
    torch.testing.assert_close(list(got), list(want), rtol=0, atol=0)
