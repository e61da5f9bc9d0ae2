"""torch.jit.save / torch.jit.load of compiled models, as Neuron scripts do."""
import io

import pytest
import torch

import kiln
from tests import models
from tests.conftest import assert_close, run_py


def test_jit_save_and_load_in_fresh_process(tmp_path):
    model = models.tiny_bert()
    inputs = models.bert_inputs()
    compiled = kiln.trace(model, inputs)
    pt = tmp_path / "bert.pt"
    torch.jit.save(compiled, str(pt))
    ref = model(**inputs)
    torch.save({"inputs": inputs, "last": ref.last_hidden_state.detach(),
                "pooled": ref.pooler_output.detach()}, tmp_path / "io.pt")
    code = f"""
import sys, torch, kiln
m = torch.jit.load({str(pt)!r})
d = torch.load({str(tmp_path / 'io.pt')!r})
out = m(d["inputs"]["input_ids"], d["inputs"]["attention_mask"])
last, pooled = out[0], out[1]
torch.testing.assert_close(last, d["last"], atol=1e-4, rtol=1e-4)
torch.testing.assert_close(pooled, d["pooled"], atol=1e-4, rtol=1e-4)
assert "transformers" not in sys.modules
print("OK")
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_jit_save_to_buffer_and_loading_without_kiln_fails_clearly(tmp_path):
    model, x = models.mlp()
    compiled = kiln.trace(model, x)
    buf = io.BytesIO()
    torch.jit.save(compiled, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    assert_close(loaded(x), model(x).detach())
    (tmp_path / "m.pt").write_bytes(buf.getvalue())
    load = f"import torch; torch.jit.load({str(tmp_path / 'm.pt')!r})"
    # import torch imports kiln itself (its torch.backends entry point), so the file loads...
    r = run_py(load + "; print('loaded')", cwd=str(tmp_path))
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]
    # ...and with device-backend autoload off, nothing imports kiln: a clear error naming it
    r = run_py(load, cwd=str(tmp_path), env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode != 0 and "kiln" in r.stderr


def test_a_jit_loaded_model_takes_its_inputs_by_name(tmp_path):
    """Found by probing: the saved module's forward was (argument_1, argument_2), so
    loaded(input_ids=..., attention_mask=...), as the traced model is called, raised
    "forward() is missing value for argument 'argument_1'". It now takes the model's names,
    in any order, or positionally in the traced order."""
    import kiln.neuronx as torch_neuronx
    model = models.tiny_bert()
    inputs = models.bert_inputs()
    inputs["attention_mask"][1, 9:] = 0             # a padded row: the mask changes the answer
    torch.jit.save(torch_neuronx.trace(model, inputs), str(tmp_path / "bert.pt"))
    ref = model(**inputs)
    torch.save({"inputs": inputs, "last": ref.last_hidden_state.detach()}, tmp_path / "io.pt")
    code = f"""
import torch, kiln
m = torch.jit.load({str(tmp_path / 'bert.pt')!r})
d = torch.load({str(tmp_path / 'io.pt')!r})
ids, mask = d["inputs"]["input_ids"], d["inputs"]["attention_mask"]
for out in (m(attention_mask=mask, input_ids=ids), m(ids, attention_mask=mask), m(ids, mask)):
    torch.testing.assert_close(out[0], d["last"], atol=1e-4, rtol=1e-4)
print("OK")
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def _declaring(src, dst, rows):
    """A copy of the artifact ``src`` whose every shape of 2 rows declares ``rows`` (unsigned)."""
    import json
    import zipfile

    def widen(o):
        if isinstance(o, dict):
            if isinstance(o.get("shape"), list) and o["shape"][:1] == [2]:
                o["shape"] = [rows] + o["shape"][1:]
            for v in o.values():
                widen(v)
        elif isinstance(o, list):
            for v in o:
                widen(v)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.namelist():
            if item != "signature.json":
                data = zin.read(item)
                if item == "manifest.json":
                    manifest = json.loads(data)
                    widen(manifest)
                    data = json.dumps(manifest).encode()
                zout.writestr(item, data)


def test_saving_a_model_that_declares_an_enormous_input_allocates_nothing(tmp_path):
    """Found by probing: torch.jit.save traced the model on zero inputs of its declared shapes,
    so a loadable artifact declaring 2^36 x 16 float32 (4 TiB) failed with the allocator's
    'DefaultCPUAllocator: can't allocate memory'. The trace now describes the call without
    running it: the file is written, and a call of another shape is the model's InputError."""
    model, x = torch.nn.ReLU(), torch.randn(2, 16)
    with pytest.warns(UserWarning, match="runs entirely on the host"):
        kiln.trace(model, x, fallback=True, ops_on_host={"aten::relu"}).save(tmp_path / "relu.kiln")
    _declaring(tmp_path / "relu.kiln", tmp_path / "huge.kiln", 2 ** 36)
    huge = kiln.load(tmp_path / "huge.kiln")
    assert huge.input_specs[0].shape == (2 ** 36, 16)
    buf = io.BytesIO()
    torch.jit.save(huge, buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    with pytest.raises(RuntimeError, match=r"InputError: input 'input': expected \(68719476736, 16\) float32, "
                                           r"got \(2, 16\)"):
        loaded(x)
    # a model of real sizes saved the same way still answers as eager does
    buf = io.BytesIO()
    torch.jit.save(kiln.load(tmp_path / "relu.kiln"), buf)
    buf.seek(0)
    assert_close(torch.jit.load(buf)(x), torch.relu(x), atol=0, rtol=0)


def test_outputs_torchscript_cannot_return_are_a_clear_error_and_a_namedtuple_is_a_tuple(tmp_path):
    """A None or a constant among the outputs: until 12-03 torch.jit.trace's own "Only tensors,
    lists, tuples of tensors, or dictionary of tensors can be output"; a namedtuple output comes
    back from ``torch.jit.load`` as a tuple, as a ModelOutput does."""
    import collections

    from kiln.errors import KilnError

    class WithNone(torch.nn.Module):
        def forward(self, x):
            return x + 1, None

    x = torch.randn(3)
    traced = kiln.trace(WithNone(), x, cache=False)
    with pytest.raises(KilnError, match=r"WithNone cannot be saved as TorchScript .*output\[1\] is None.*\.kiln"):
        torch.jit.save(traced, str(tmp_path / "none.pt"))
    pair = collections.namedtuple("Pair", "a b")

    class Named(torch.nn.Module):
        def forward(self, x):
            return pair(x * 2, x - 1)

    torch.jit.save(kiln.trace(Named(), x, cache=False), str(tmp_path / "pair.pt"))
    a, b = torch.jit.load(str(tmp_path / "pair.pt"))(x)
    assert_close(a, x * 2)
    assert_close(b, x - 1)
