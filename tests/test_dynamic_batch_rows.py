"""Dynamic batch and DataParallel split a batch only where kiln.trace proved, against eager, that
splitting gives the model's answers; never decided by dim 0's size or from a call's rows."""
import pytest
import torch

import kiln
from kiln import InputError


class _RowsAndMean(torch.nn.Module):
    def forward(self, x):
        return x * 2, x.mean(0)          # mean over rows: 8 features, as many as the batch of 8


class _Shared(torch.nn.Module):
    def forward(self, x, table):
        return x @ table.t()             # table: shared by every row, dim 0 == the batch by chance


def test_an_output_with_the_batch_on_dim_0_by_coincidence_is_not_joined():
    """kiln.dynamic_batch took x.mean(0) (shape [8], batch 8) for a per-row output: 16 rows gave
    a (16,) tensor of the two chunks' means, where eager gives (8,). kiln.trace's row check
    finds it, and a split call is the documented InputError."""
    model = _RowsAndMean()
    wrapped = kiln.dynamic_batch(kiln.trace(model, torch.randn(8, 8)))
    eight = torch.randn(8, 8)
    doubled, mean = wrapped(eight)       # the compiled batch: one chunk, both right
    torch.testing.assert_close(mean, eight.mean(0))
    with pytest.raises(InputError, match=r"not proven .* the model mixes the rows of a batch"):
        wrapped(torch.randn(16, 8))
    assert "mixes" in wrapped.inner.manifest["row_check"]
    with pytest.raises(InputError, match=r"mixes the rows"):   # saved with the record
        kiln.load(wrapped.to_bytes())(torch.randn(3, 8))


def test_per_row_outputs_still_follow_the_rows_after_measuring():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    wrapped = kiln.dynamic_batch(kiln.trace(model, torch.randn(8, 8)))
    for n in (3, 8, 13, 1):
        x = torch.randn(n, 8)
        torch.testing.assert_close(wrapped(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert wrapped(torch.randn(0, 8)).shape == (0, 8)      # measured: an empty batch has an answer


def test_a_shared_table_with_the_batch_rows_is_a_clear_error():
    x, table = torch.randn(4, 8), torch.randn(4, 8)
    wrapped = kiln.dynamic_batch(kiln.trace(_Shared(), (x, table)))
    with pytest.raises(InputError, match=r"If 'table' is shared by every row \(a table\)"):
        wrapped(torch.randn(6, 8), table)


def test_data_parallel_measures_which_outputs_follow_the_rows_too():
    """DataParallel without dynamic batching joined x.mean(0) (batch 8, 8 features) of two
    replicas' chunks into a (16,) tensor, values 0.4 off eager's (8,): now refused (the trace's
    row check); a per-row model is still split and joined."""
    model = _RowsAndMean()
    compiled = kiln.trace(model, torch.randn(8, 8), cache=False, quiet=True)
    with kiln.DataParallel(compiled, device_ids=[0], dynamic_batching=False) as dp:
        with pytest.raises(InputError, match=r"a batch of 16 along dim 0 .* mixes the rows"):
            dp(torch.randn(16, 8))
    linear = torch.nn.Linear(8, 8).eval()
    with kiln.DataParallel(kiln.trace(linear, torch.randn(8, 8), cache=False, quiet=True), device_ids=[0],
                           dynamic_batching=False) as rows:
        x = torch.randn(16, 8)
        torch.testing.assert_close(rows(x), linear(x).detach(), atol=1e-5, rtol=1e-5)


class _Softmax0(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, 0)


class _PerBatch(torch.nn.Module):
    def forward(self, x):
        return x / x.shape[0]


class _Cumsum(torch.nn.Module):
    def forward(self, x):
        return x.cumsum(0)


class _PooledAtBatch1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x), x.mean(0, keepdim=True)


@pytest.mark.parametrize("model", [_Softmax0(), _PerBatch(), _Cumsum()], ids=["softmax0", "per_batch", "cumsum"])
def test_neuronx_dynamic_batch_never_splits_rows_that_interact(model):
    """torch_neuronx.dynamic_batch had no proof, only a run-time roll of the rows by one, blind to
    ops that treat all rows alike: traced at 4, softmax(x, 0) was 0.50 off at 2 rows, x / x.shape[0]
    0.83 off; and a first call of all-alike rows (zeros) was kept as "follows" for good, cumsum(0)
    then 2.03 off at 8 rows. Now a split needs kiln.trace's check against eager: refused."""
    import kiln.neuronx
    wrapped = kiln.neuronx.dynamic_batch(kiln.neuronx.trace(model, torch.randn(4, 3)))
    four = torch.randn(4, 3)
    torch.testing.assert_close(wrapped(four), model(four))          # the compiled batch: whole
    for rows in (torch.zeros(6, 3), torch.randn(2, 3), torch.randn(8, 3)):
        with pytest.raises(InputError, match=r"mixes the rows .* Call with 4 rows, or trace with kiln.trace"):
            wrapped(rows)


def test_an_output_reduced_over_a_batch_of_one_is_not_repeated_per_row():
    """Traced at batch 1, x.mean(0, keepdim=True) (shape [1, 3]) came back once per row: (5, 3)
    where eager gives (1, 3)."""
    model = _PooledAtBatch1().eval()
    wrapped = kiln.dynamic_batch(kiln.trace(model, torch.randn(1, 3)))
    one = torch.randn(1, 3)
    torch.testing.assert_close(wrapped(one), model(one), atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="mixes the rows"):
        wrapped(torch.randn(5, 3))


def test_a_model_without_the_trace_time_record_is_not_split():
    """An artifact of an older kiln carries no row check: it runs at its compiled batch only."""
    linear = torch.nn.Linear(8, 8).eval()
    compiled = kiln.trace(linear, torch.randn(4, 8))
    assert compiled.manifest["row_check"]["follows_rows"] == [True]
    del compiled.manifest["row_check"]
    wrapped = kiln.dynamic_batch(kiln.load(compiled.to_bytes()))
    with pytest.raises(InputError, match="carries no trace-time proof"):
        wrapped(torch.randn(3, 8))
    x = torch.randn(4, 8)
    torch.testing.assert_close(wrapped(x), linear(x).detach(), atol=1e-5, rtol=1e-5)


class _MixedAndShared(torch.nn.Module):
    def forward(self, x, table):
        return torch.softmax(x, 0) @ table.t()      # rows mixed; table shared, with 4 rows as the batch


def test_data_parallel_runs_the_compiled_batch_whole_when_rows_are_not_proven_independent():
    """DataParallel split every batch into ceil(n / replicas) rows, the compiled one too: on 2 cores
    softmax(x, 0) traced at 4 and called with those 4 rows was 0.419 off, and x @ w (w with 4 rows,
    taken for a batched input) raised "a batch of 2 rows ... call with 4 rows" although called with 4."""
    model, x, table = _MixedAndShared(), torch.randn(4, 4), torch.randn(4, 4)
    with kiln.DataParallel(kiln.trace(model, (x, table)), device_ids=[0, 1]) as dp:
        torch.testing.assert_close(dp(x, table), model(x, table), atol=1e-5, rtol=1e-5)
        with pytest.raises(InputError, match="DataParallel"):
            dp(torch.randn(8, 4), table)


class _PairDiff(torch.nn.Module):
    """Siamese pairs of rows (0, 1), (2, 3), ...: one value per pair; eager runs even batches only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x).reshape(-1, 2, 3)
        return (h[:, 0] - h[:, 1]).norm(dim=-1)


def test_dynamic_batch_is_checked_at_a_batch_eager_runs_when_one_row_more_fails():
    """Eager cannot run 5 rows, the check was skipped, and a skipped check counted as the caller's
    request: 8 rows gave 2 values where eager gives 4, and 2 rows [2.142, 0.0] for eager's [2.142].
    The check now runs 6 rows, where the answer's shape shows that chunks cannot give eager's."""
    with pytest.raises(kiln.ValidationError, match=r"output 'output0' depends on the batch size.*"
                                                   r"\(2,\) at 4 rows .* \(3,\) at 6 rows"):
        kiln.trace(_PairDiff().eval(), torch.randn(4, 3), dynamic_batch=True)


def test_a_dynamic_batch_whose_check_eager_could_not_run_is_not_split(tmp_path):
    """An artifact whose batch_check was skipped because eager failed (as kiln traced PairDiff until
    12-01, and kiln serve then served its wrong answers) runs its compiled batch only."""
    model = _PairDiff().eval()
    inner = kiln.trace(model, torch.randn(4, 3), validate=False)
    saved = kiln.DynamicBatch(inner)
    saved.settle_rows([False])
    saved.manifest["batch_check"] = {"rows": 5, "skipped": "eager failed on 5 rows: RuntimeError: shape"}
    saved.save(tmp_path / "pair.kiln")
    loaded = kiln.load(tmp_path / "pair.kiln")
    four = torch.randn(4, 3)
    torch.testing.assert_close(loaded(four), model(four).detach(), atol=1e-5, rtol=1e-5)
    for n in (8, 2):
        with pytest.raises(InputError, match=r"not proven .* could not check at trace time .*eager failed on 5 rows"):
            loaded(torch.randn(n, 3))


class _PairScale(torch.nn.Module):
    """Row-wise, but written over pairs of rows: eager runs even batches only."""

    def forward(self, x):
        return (x.reshape(-1, 2, x.shape[1]) * 2).reshape(-1, x.shape[1])


def test_a_model_eager_runs_at_even_batches_only_splits_even_batches_only():
    model = _PairScale().eval()
    m = kiln.trace(model, torch.randn(4, 3), dynamic_batch=True)
    check = m.manifest["batch_check"]
    assert check["rows"] == 6 and check["row_multiple"] == 2 and check["max_abs_error"] < 1e-5
    for n in (2, 6, 10):
        x = torch.randn(n, 3)
        torch.testing.assert_close(m(x), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match=r"a batch of 5 rows, but this model takes only multiples of 2 rows"):
        m(torch.randn(5, 3))        # eager raises for 5 rows; a padded chunk would answer


class _Squeezed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x).squeeze()     # () at 1 row, (B,) at B


def test_an_output_whose_shape_depends_on_the_batch_size_is_named_as_such():
    """Traced at batch 1, squeeze() was refused as "Rows of a batch interact in this model"."""
    with pytest.raises(kiln.ValidationError) as err:
        kiln.trace(_Squeezed().eval(), torch.randn(1, 4), dynamic_batch=True)
    msg = str(err.value)
    assert "shape of its output 'output0' depends on the batch size" in msg
    assert "() at 1 row" in msg and "(2,) at 2 rows" in msg and "Rows of a batch interact" not in msg
    wrapped = kiln.dynamic_batch(kiln.trace(_Squeezed().eval(), torch.randn(1, 4)))
    with pytest.raises(InputError, match=r"an output's shape depends on the batch size .*'output0'"):
        wrapped(torch.randn(3, 4))
