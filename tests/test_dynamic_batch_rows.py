"""Dynamic batch decides which outputs follow the rows by measuring, not by dim 0's size."""
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
    a (16,) tensor of the two chunks' means, where eager gives (8,). Now it is measured (the
    rows rolled once) and a split call is the documented InputError naming it."""
    model = _RowsAndMean()
    wrapped = kiln.dynamic_batch(kiln.trace(model, torch.randn(8, 8)))
    eight = torch.randn(8, 8)
    doubled, mean = wrapped(eight)       # the compiled batch: one chunk, both right
    torch.testing.assert_close(mean, eight.mean(0))
    with pytest.raises(InputError, match=r"output\(s\) \[1\] do not follow the batch"):
        wrapped(torch.randn(16, 8))
    assert wrapped.manifest["dynamic_batch"]["follows_rows"] == [True, False]
    with pytest.raises(InputError, match=r"\[1\] do not follow"):   # saved with the measurement
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
    replicas' chunks into a (16,) tensor, values 0.4 off eager's (8,); its per-row output is
    still joined."""
    model = _RowsAndMean()
    compiled = kiln.trace(model, torch.randn(8, 8), cache=False, quiet=True)
    with kiln.DataParallel(compiled, device_ids=[0], dynamic_batching=False) as dp:
        with pytest.raises(InputError, match=r"output\(s\) \[1\] do not follow the batch along dim 0"):
            dp(torch.randn(16, 8))
    linear = torch.nn.Linear(8, 8).eval()
    with kiln.DataParallel(kiln.trace(linear, torch.randn(8, 8), cache=False, quiet=True), device_ids=[0],
                           dynamic_batching=False) as rows:
        x = torch.randn(16, 8)
        torch.testing.assert_close(rows(x), linear(x).detach(), atol=1e-5, rtol=1e-5)
