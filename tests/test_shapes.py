"""Bucketing and dynamic batch: compiled static shapes serving variable inputs."""
import pytest
import torch

import kiln
import kiln.neuron
import kiln.neuronx
from kiln.errors import CompilerArgsError, InputError

from . import models
from .conftest import assert_close, run_py
from tests import forkserver

BUCKETS = [8, 16, 32]


@pytest.fixture(scope="module")
def bert():
    return models.tiny_bert()


@pytest.fixture(scope="module")
def bucketed(bert):
    return kiln.trace(bert, models.bert_inputs(batch=2, seq=16),
                      buckets={"input_ids": {1: BUCKETS}}, pad_values={"attention_mask": 0})


def _inputs(batch, seq, real=None):
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, 120, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if real is not None:
        mask[-1, real:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_bucketed_bert_matches_eager_on_unpadded_inputs(bert, bucketed):
    assert isinstance(bucketed, kiln.Bucketed)
    assert len(bucketed.variants) == 3
    # attention_mask follows input_ids on the sequence axis, without being named
    names = {bucketed.input_specs[i].name for i, _ in bucketed.axes[0]["inputs"]}
    assert names == {"input_ids", "attention_mask"}
    for seq in (3, 8, 13, 16, 29, 32):
        inputs = _inputs(2, seq, real=max(1, seq - 2))
        with torch.no_grad():
            expected = bert(**inputs)
        got = bucketed(**inputs)
        assert got.last_hidden_state.shape == (2, seq, 32)   # sliced back to the real length
        assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-4, rtol=1e-4)
        assert_close(got.pooler_output, expected.pooler_output, atol=1e-4, rtol=1e-4)


def test_smallest_fitting_bucket_is_used(bucketed):
    before = [v.calls for v in bucketed.variants]
    bucketed(**_inputs(2, 9))      # needs 16: not 8, not 32
    after = [v.calls for v in bucketed.variants]
    sizes = [s[0] for s in bucketed.variant_sizes]
    assert [a - b for a, b in zip(after, before)] == [int(s == 16) for s in sizes]


def test_input_past_the_largest_bucket_is_a_clear_error(bucketed):
    with pytest.raises(InputError, match=r"input_ids' dim 1 is 40, larger than the largest bucket "
                                         r"\(32\).*8, 16, 32"):
        bucketed(**_inputs(2, 40))
    with pytest.raises(InputError, match=r"dim 0 must be 2 \(it is not bucketed\)"):
        bucketed(**_inputs(3, 8))
    bad = _inputs(2, 8)
    bad["attention_mask"] = bad["attention_mask"][:, :6]
    with pytest.raises(InputError, match="same bucketed axis"):
        bucketed(**bad)


def test_manifest_records_buckets_and_compile_times(bucketed, tmp_path):
    meta = bucketed.manifest["buckets"]
    assert sorted(v["sizes"][0] for v in meta["variants"]) == BUCKETS
    assert all(v["compile_seconds"] > 0 for v in meta["variants"])
    assert meta["output_dims"] == [[0, 1, 0]]           # last_hidden_state dim 1 follows the axis
    path = tmp_path / "bert-buckets.kiln"
    bucketed.save(path)
    loaded = kiln.load(path)
    assert isinstance(loaded, kiln.Bucketed)
    inputs = _inputs(2, 11, real=7)
    assert_close(loaded(**inputs).last_hidden_state, bucketed(**inputs).last_hidden_state,
                 atol=0, rtol=0)


def test_bucket_list_of_examples_infers_the_axis():
    model, _ = models.mlp()
    compiled = kiln.trace(model, buckets=[torch.randn(1, 16), torch.randn(4, 16), torch.randn(8, 16)])
    assert compiled.variant_sizes == [[1], [4], [8]]
    for n in (1, 3, 6, 8):
        x = torch.randn(n, 16)
        assert_close(compiled(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_outputs_that_follow_no_bucketed_dim_are_rejected():
    class Flat(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x.flatten(), x.flatten()])

    with pytest.raises(CompilerArgsError, match="follows no bucketed input dim; declare it"):
        kiln.trace(Flat(), buckets=[torch.randn(1, 4), torch.randn(2, 4)])


def test_bad_bucket_specs_are_clear_errors(bert):
    with pytest.raises(CompilerArgsError, match="buckets names input 'ids'"):
        kiln.trace(bert, models.bert_inputs(), buckets={"ids": {1: [8]}})
    with pytest.raises(CompilerArgsError, match="has no dim 2"):
        kiln.trace(bert, models.bert_inputs(), buckets={"input_ids": {2: [8]}})
    # sizes that are not a list of integers (a raw TypeError, or 4.5 read as 4, until 12-03)
    for sizes in (True, 8, [4, 8.5]):
        with pytest.raises(CompilerArgsError, match=r"buckets\['input_ids'\]\[1\] must be a list of sizes"):
            kiln.trace(bert, models.bert_inputs(), buckets={"input_ids": {1: sizes}})


def test_a_dict_with_keys_that_are_not_strings_is_a_clear_error():
    class IntKeys(torch.nn.Module):
        def forward(self, x):
            return {3: x + 1}

    with pytest.raises(kiln.errors.KilnError, match="dict keys must be strings: .*the key 3 \\(int\\).*str keys"):
        kiln.trace(IntKeys(), torch.randn(2), cache=False)


@pytest.fixture(scope="module")
def mlp_dynamic():
    model, x = models.mlp()
    return model, kiln.trace(model, x, dynamic_batch=True)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_dynamic_batch_equals_eager(mlp_dynamic, n):
    model, compiled = mlp_dynamic
    x = torch.randn(n, 16)
    assert_close(compiled(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_dynamic_batch_other_dims_must_match(mlp_dynamic):
    _, compiled = mlp_dynamic
    with pytest.raises(InputError, match=r"only dim 0 may differ.*'x': expected \(N, 16\) float32 "
                                         r"\(any batch size N\), got \(5, 17\)"):
        compiled(torch.randn(5, 17))
    # an empty batch has an answer: no rows (every output follows the batch)
    empty = compiled(torch.randn(0, 16))
    assert empty.shape == (0, 4) and empty.dtype == torch.float32


def test_dynamic_batch_survives_save_and_load(mlp_dynamic):
    model, compiled = mlp_dynamic
    loaded = kiln.load(compiled.to_bytes())
    assert isinstance(loaded, kiln.DynamicBatch) and loaded.batch_size == 2
    x = torch.randn(5, 16)
    assert_close(loaded(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_neuron_spellings_of_dynamic_batch():
    model, x = models.mlp()
    traced = kiln.neuronx.trace(model, x)
    wrapped = kiln.neuronx.dynamic_batch(traced)
    y = torch.randn(9, 16)
    assert_close(wrapped(y), model(y).detach(), atol=1e-5, rtol=1e-5)
    first_gen = kiln.neuron.trace(model, x, dynamic_batch_size=True)
    assert_close(first_gen(y), model(y).detach(), atol=1e-5, rtol=1e-5)


def test_dynamic_batch_over_buckets(bert, bucketed):
    both = kiln.dynamic_batch(bucketed)
    inputs = _inputs(5, 13, real=9)
    with torch.no_grad():
        expected = bert(**inputs).last_hidden_state
    assert_close(both(**inputs).last_hidden_state, expected, atol=1e-4, rtol=1e-4)


def test_bucketed_model_loads_in_a_fresh_process(bucketed, tmp_path):
    path = tmp_path / "b.kiln"
    bucketed.save(path)
    inputs = _inputs(2, 5, real=3)
    torch.save(inputs, tmp_path / "in.pt")
    torch.save(bucketed(**inputs).last_hidden_state, tmp_path / "out.pt")
    r = run_py(f"""
import torch, kiln
m = kiln.load({str(path)!r})
out = m(**torch.load({str(tmp_path / 'in.pt')!r})).last_hidden_state
torch.testing.assert_close(out, torch.load({str(tmp_path / 'out.pt')!r}), atol=0, rtol=0)
print(type(m).__name__, tuple(out.shape))
""")
    assert r.returncode == 0, r.stderr
    assert "Bucketed (2, 5, 32)" in r.stdout


def test_cli_inspects_nested_artifacts(tmp_path, kiln_cli):
    model, _ = models.mlp()
    compiled = kiln.trace(model, buckets=[torch.randn(1, 16), torch.randn(4, 16)])
    path = tmp_path / "mlp-buckets.kiln"
    compiled.save(path)
    r = forkserver.run([kiln_cli, "inspect", str(path)], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "(bucketed)" in r.stdout and "variants" in r.stdout
    assert r.stdout.count("sha256") == 2              # both variants' partition tables
