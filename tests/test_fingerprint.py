"""The compile cache's fingerprint (kiln.compiler.fingerprint): an alias read before any
capture, so two models that compute differently must never share one (the second was
served the first's artifact: found by probing, errors of 0.27-4.0), while the same model
built twice, in any process, shares it."""
import functools
import importlib
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.compiler.fingerprint import fingerprint
from kiln.compiler.options import CompileOptions

X = torch.randn(2, 16)


def fp(model):
    return fingerprint(model, {"x": X}, CompileOptions(device="cpu"))


class Act(torch.nn.Module):
    """A Linear and an activation kept as a plain attribute (a function, a partial...)."""

    def __init__(self, act, extra=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 8)
        self.act = act
        self.extra = extra

    def forward(self, x):
        y = self.act(self.lin(x))
        if isinstance(self.extra, torch.Tensor):
            y = y * self.extra
        elif isinstance(self.extra, list) and self.extra and isinstance(self.extra[0], torch.Tensor):
            y = y + self.extra[0][1000]
        elif isinstance(self.extra, list):
            y = self.extra[0](y)
        elif self.extra is not None:
            y = y * self.extra.k
        return y


class Helper:
    def __init__(self, k):
        self.k = k


class Named(Helper):
    def __repr__(self):             # a repr that leaves the setting out
        return "Named()"


def closure(s):
    return lambda t: t * s


def big(v):
    t = torch.zeros(2000)
    t[1000] = v
    return [t]


def layer(seed):
    torch.manual_seed(seed)
    return [torch.nn.Linear(8, 8)]


PAIRS = {   # each builds a model that computes differently from the other's
    "plain tensor attribute": lambda k: Act(torch.tanh, torch.tensor(2.0 + k)),
    "functools.partial": lambda k: Act(functools.partial(F.leaky_relu, negative_slope=0.1 + 0.4 * k)),
    "lambda constant": lambda k: Act([lambda t: t * 2.0, lambda t: t * 3.0][k]),
    "closure": lambda k: Act(closure(2.0 + k)),
    "helper object": lambda k: Act(torch.tanh, Helper(2.0 + k)),
    "helper object with its own repr": lambda k: Act(torch.tanh, Named(2.0 + k)),
    "tensor past its printed part": lambda k: Act(torch.tanh, big(1.0 + 4 * k)),
    "layer in a plain list": lambda k: Act(torch.tanh, layer(k)),
}


@pytest.mark.parametrize("case", PAIRS)
def test_models_that_compute_differently_never_share_a_fingerprint(case):
    a, b, again = PAIRS[case](0), PAIRS[case](1), PAIRS[case](0)
    with torch.no_grad():
        assert not torch.allclose(a(X), b(X))
    assert None not in (fp(a), fp(b))
    assert fp(a) != fp(b)
    assert fp(a) == fp(again)            # the same model built twice still shares it


def test_what_the_code_reads_outside_the_model(tmp_path, monkeypatch):
    """A global set at run time, a helper in another file of the project edited (and
    reloaded, as notebooks' autoreload does) and a class typed where there is no source
    file to read (``python -c``, a notebook) each change the fingerprint."""
    (tmp_path / "fp_helpers.py").write_text("def scale(t):\n    return t * 2.0\n")
    (tmp_path / "fp_model.py").write_text(textwrap.dedent("""
        import torch
        from fp_helpers import scale
        SHIFT = 1.0
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(16, 8)
            def forward(self, x):
                return scale(self.lin(x)) + SHIFT
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fp_model", "fp_helpers"):
        sys.modules.pop(name, None)
    mod = importlib.import_module("fp_model")
    first = fp(mod.Net())
    monkeypatch.setattr(mod, "SHIFT", 5.0)
    second = fp(mod.Net())
    (tmp_path / "fp_helpers.py").write_text("def scale(t):\n    return t * 3.0  # edited\n")
    importlib.reload(sys.modules["fp_helpers"])
    third = fp(mod.Net())
    assert len({first, second, third}) == 3

    def typed(constant):
        space = {"torch": torch}
        exec(compile("class Typed(torch.nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n        torch.manual_seed(0)\n"
                     "        self.lin = torch.nn.Linear(16, 8)\n"
                     f"    def forward(self, x):\n        return self.lin(x) * {constant}\n",
                     "<stdin>", "exec"), space)
        return space["Typed"]()
    assert fp(typed(2.0)) != fp(typed(3.0))


def test_state_it_cannot_read_turns_the_fast_path_off(tmp_path):
    """An attribute with no state to read (a lock) makes the fingerprint None: the model is
    captured and keyed by its graph every time, and answers right."""
    model = Act(torch.tanh)
    model.lock = threading.Lock()
    assert fp(model) is None
    url = str(tmp_path / "cache")
    compiled = kiln.trace(model, X, cache=url, optlevel=1)
    torch.testing.assert_close(compiled(X), model(X).detach(), atol=1e-5, rtol=1e-5)


def test_hugging_face_models_keep_the_fast_path():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, vocab_size=100)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(transformers.LlamaForCausalLM(cfg).eval())
    ids = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    a, b = (fingerprint(m, ids, CompileOptions(device="cpu")) for m in models)
    assert a is not None and a == b


def test_a_warm_cache_serves_each_model_its_own_artifact(tmp_path):
    """End to end: two models that differ only in a lambda's constant, traced into one
    cache; the second was an alias hit on the first's entry and answered 0.8 off."""
    url = str(tmp_path / "cache")
    a, b = PAIRS["lambda constant"](0), PAIRS["lambda constant"](1)
    ca, cb = kiln.trace(a, X, cache=url, optlevel=1), kiln.trace(b, X, cache=url, optlevel=1)
    assert ca.cache_key != cb.cache_key
    torch.testing.assert_close(cb(X), b(X).detach(), atol=1e-5, rtol=1e-5)
    again = kiln.trace(PAIRS["lambda constant"](1), X, cache=url, optlevel=1)
    assert again.manifest["cache"]["hit"] and again.cache_key == cb.cache_key


def test_an_entry_holding_another_keys_artifact_is_discarded(tmp_path):
    """The signed manifest records the key an artifact was compiled for: an entry whose
    artifact is another key's (moved or copied in a shared store) was served as it stood."""
    import shutil

    from kiln.compiler import cache
    url = tmp_path / "cache"
    a, b = PAIRS["closure"](0), PAIRS["closure"](1)
    key_a = kiln.trace(a, X, cache=str(url), optlevel=1).cache_key
    key_b = kiln.trace(b, X, cache=str(url), optlevel=1).cache_key
    for name in ("artifact.kiln", "meta.json"):
        shutil.copy(url / "entries" / key_b / name, url / "entries" / key_a / name)
    before = dict(cache.stats)
    again = kiln.trace(PAIRS["closure"](0), X, cache=str(url), optlevel=1)
    torch.testing.assert_close(again(X), a(X).detach(), atol=1e-5, rtol=1e-5)
    assert cache.stats["discarded"] == before.get("discarded", 0) + 1
