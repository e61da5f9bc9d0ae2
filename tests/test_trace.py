"""kiln.trace on tiny models: compiled outputs match eager PyTorch."""
import pytest
import torch

import kiln
from tests import models
from tests.conftest import assert_close


def test_mlp_matches_eager():
    model, x = models.mlp()
    compiled = kiln.trace(model, x)
    assert isinstance(compiled, kiln.CompiledModel)
    assert_close(compiled(x), model(x).detach())
    # a different input of the same shape gives the model's answer, not a cached one
    x2 = torch.randn_like(x)
    assert_close(compiled(x2), model(x2).detach())
    m = compiled.manifest
    assert m["report"]["support_percentage"] == 100.0
    assert len(m["partitions"]) == 1 and m["partitions"][0]["engine"] == "onnxruntime"
    assert m["validation"]["passed"] and m["validation"]["max_abs_error"] < 1e-5


def test_cnn_matches_eager():
    model, x = models.cnn()
    compiled = kiln.trace(model, x)
    assert_close(compiled(x), model(x).detach())


def test_tiny_bert_with_mask_returns_model_output():
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
    model = models.tiny_bert()
    inputs = models.bert_inputs()
    compiled = kiln.trace(model, inputs)
    out = compiled(**inputs)
    ref = model(**inputs)
    assert isinstance(out, BaseModelOutputWithPoolingAndCrossAttentions)
    assert_close(out.last_hidden_state, ref.last_hidden_state.detach())
    assert_close(out["pooler_output"], ref.pooler_output.detach())
    assert_close(out[0], ref[0].detach())
    # positional call, and the attention mask is really used (masked tokens change nothing)
    out_pos = compiled(inputs["input_ids"], inputs["attention_mask"])
    assert_close(out_pos.last_hidden_state, out.last_hidden_state)
    ids = inputs["input_ids"].clone()
    ids[-1, 12:] = 7  # only masked positions change
    changed = compiled(input_ids=ids, attention_mask=inputs["attention_mask"]).last_hidden_state
    assert_close(changed[-1, :8], out.last_hidden_state[-1, :8])
    assert not torch.allclose(changed[-1, 12:], out.last_hidden_state[-1, 12:])


def test_tiny_resnet():
    model = models.tiny_resnet()
    x = torch.randn(2, 3, 32, 32)
    compiled = kiln.trace(model, x)
    out, ref = compiled(x), model(x)
    assert_close(out.pooler_output, ref.pooler_output.detach())
    assert_close(out.last_hidden_state, ref.last_hidden_state.detach())


def test_pytree_inputs_and_outputs():
    torch.manual_seed(0)
    model = models.Pytree().eval()
    a, b, w = torch.randn(2, 4), torch.randn(2, 4), torch.randn(4)
    compiled = kiln.trace(model, ((a, b), {"w": w}))
    out = compiled((a, b), {"w": w})
    ref = model((a, b), {"w": w})
    assert set(out) == {"y", "stats", "none"} and out["none"] is None
    assert isinstance(out["stats"], list) and len(out["stats"]) == 2
    assert_close(out["y"], ref["y"].detach())
    assert_close(out["stats"][1], ref["stats"][1].detach())
    names = [s.name for s in compiled.input_specs]
    assert names == ["pair[0]", "pair[1]", "extras.w"]
    with pytest.raises(kiln.InputError, match=r"extras.*expected keys"):
        compiled((a, b), {"v": w})


def test_validation_gate_fails_beyond_tolerance():
    """An impossible tolerance fails the gate with the error numbers in the message."""
    model = models.tiny_bert()
    with pytest.raises(kiln.ValidationError, match=r"max abs error .* cosine similarity") as info:
        kiln.trace(model, models.bert_inputs(), atol=0.0, rtol=0.0)
    assert info.value.metrics["passed"] is False


def test_threads_and_concurrent_calls():
    from concurrent.futures import ThreadPoolExecutor
    model, _ = models.mlp()
    compiled = kiln.trace(model, torch.randn(2, 16), threads=1)
    session = compiled.program.partitions[0].session
    assert session.get_session_options().intra_op_num_threads == 1
    xs = [torch.randn(2, 16) for _ in range(32)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(compiled, xs))
    for x, y in zip(xs, outs):
        assert_close(y, model(x).detach())
    assert compiled.calls >= 32


def test_capture_error_points_at_user_line():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:   # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(kiln.CaptureError) as info:
        kiln.trace(Branchy(), torch.randn(3))
    msg = str(info.value)
    assert "data-dependent" in msg
    assert "test_trace.py" in msg and "x.sum() > 0" in msg


def test_training_mode_model_compiled_in_eval_and_left_untouched():
    model, x = models.cnn()
    model.train()
    compiled = kiln.trace(model, x)
    assert model.training  # the user's module is left as it was
    model.eval()
    assert_close(compiled(x), model(x).detach())   # BatchNorm used running stats


def test_a_data_dependent_branch_is_named_at_the_users_line(tmp_path, monkeypatch):
    """torch cuts the start off the path in its message ("Caused by: (mp/.../m.py:30 in
    forward)"), and the error (and kiln port's report) named a file that does not exist."""
    import importlib
    import sys
    (tmp_path / "branchy_model.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        v = x.max().item()\n"
        "        if v > 100:\n"
        "            x = x - 1\n"
        "        return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("branchy_model")
    try:
        with pytest.raises(kiln.CaptureError) as e:
            kiln.trace(module.M(), torch.randn(2, 3))
    finally:
        sys.modules.pop("branchy_model", None)
    assert f"at {tmp_path / 'branchy_model.py'}:5 in forward: if v > 100:" in str(e.value)


def test_trace_puts_each_modules_own_mode_back():
    """A model fine-tuned with a frozen batch norm (the model training, the norm in eval mode)
    came back from kiln.trace with every module training (capture ended with model.train()), so
    the frozen statistics moved at the next step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()
    kiln.trace(model, torch.randn(3, 4), cache=False, quiet=True)
    assert [m.training for m in model] == [True, False, True] and model.training


def test_numpy_arrays_are_example_inputs_as_tensors_are():
    """README: inputs may be a tensor or a NumPy array. At trace time a bare array had its rows
    taken as separate positional inputs ("too many positional arguments") and one in a tuple
    was refused ("values of type ndarray are not supported as model inputs")."""
    import numpy as np
    model = torch.nn.Linear(4, 3).eval()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    expected = model(torch.from_numpy(x)).detach()
    for example in (x, (x,), {"input": x}):
        compiled = kiln.trace(model, example, quiet=True, cache=False, optlevel=1)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled(torch.from_numpy(x)), expected, rtol=1e-5, atol=1e-6)
    frozen = x.copy()
    frozen.flags.writeable = False
    compiled = kiln.trace(model, frozen[::-1], quiet=True, cache=False, optlevel=1)
    torch.testing.assert_close(compiled(x[::-1].copy()), model(torch.from_numpy(x[::-1].copy())).detach(),
                               rtol=1e-5, atol=1e-6)


class _ReturnsBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(3.0))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.b, self.lin(x) + self.b


def test_a_returned_constant_is_a_fresh_tensor_at_each_call(tmp_path):
    """An output that is a buffer was one host-constant tensor returned by every call: after
    the caller's out[0].add_(100), later calls returned b + 100 as output 0 while output 1
    still used b. Each call now returns its own copy (loaded models too)."""
    model, x = _ReturnsBuffer().eval(), torch.randn(2, 3)
    expected = tuple(t.detach() for t in model(x))
    compiled = kiln.trace(model, x, quiet=True, cache=False, optlevel=1)
    for m in (compiled, kiln.load(compiled.save(str(tmp_path / "b.kiln")) or str(tmp_path / "b.kiln"))):
        first = m(x)
        first[0].add_(100)
        again = m(x)
        torch.testing.assert_close(again[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(again[1], expected[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.b, torch.arange(3.0), rtol=0, atol=0)


class _WithDefaults(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, token_type_ids=None, flag=False, scale=1.0):
        y = self.lin(x) * scale
        if token_type_ids is not None:
            y = y + token_type_ids
        return -y if flag else y


def test_an_explicit_value_equal_to_the_traced_default_is_accepted(tmp_path):
    """Passing token_type_ids=None or flag=False explicitly, the defaults the example call
    left out, was refused as "unexpected input"; it is the graph's own value, so it is
    accepted (after a save and load too), and a different value is refused naming the default."""
    from kiln.errors import InputError
    model, x = _WithDefaults().eval(), torch.randn(2, 4)
    expected = model(x).detach()
    compiled = kiln.trace(model, x, quiet=True, cache=False, optlevel=1)
    path = str(tmp_path / "d.kiln")
    compiled.save(path)
    for m in (compiled, kiln.load(path)):
        torch.testing.assert_close(m(x, token_type_ids=None, flag=False, scale=1.0), expected, rtol=1e-5, atol=1e-6)
        with pytest.raises(InputError, match="flag.*compiled with flag left to its default False"):
            m(x, flag=True)
        with pytest.raises(InputError, match="token_type_ids.*default None"):
            m(x, token_type_ids=torch.zeros(2, 3))
        torch.testing.assert_close(m(x, scale=1), expected, rtol=1e-5, atol=1e-6)
        with pytest.raises(InputError, match="scale"):
            m(x, scale=2.0)
        with pytest.raises(InputError, match="unexpected input 'other'"):
            m(x, other=None)
    # a bucketed model takes them too (its flatten view carries the variants' defaults), and an
    # unknown keyword is an InputError there as well, not an AttributeError
    bucketed = kiln.trace(model, x, buckets=[x[:1], x], quiet=True, cache=False, optlevel=1)
    torch.testing.assert_close(bucketed(x, flag=False), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="unexpected input 'other'"):
        bucketed(x, other=None)
