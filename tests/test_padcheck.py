"""Padding and batching never change answers: kiln.trace proves it or refuses (issue 14)."""
import pytest
import torch

import kiln
from kiln.errors import ValidationError

from . import models
from .conftest import assert_close


@pytest.fixture(scope="module")
def bert():
    return models.tiny_bert()


def test_buckets_that_let_the_model_see_padding_are_refused(bert):
    # No attention mask: BERT attends to the zero padding, so a 1x5 input padded to 16
    # would answer for the padded input (the issue measured 0.017 off at 1x5, with no warning).
    ids = torch.randint(1, 120, (1, 64))
    with pytest.raises(ValidationError) as err:
        kiln.trace(bert, {"input_ids": ids}, buckets={"input_ids": {1: [16, 32, 64]}})
    msg = str(err.value)
    assert "padding changes the answers of BertModel" in msg
    assert "'input_ids' dim 1" in msg and "max abs error" in msg
    assert "attention_mask" in msg and "pad_values" in msg
    assert err.value.metrics["max_abs_error"] > 1e-3


def test_masked_buckets_pass_the_check_and_record_it(bert, tmp_path):
    ids = torch.randint(1, 120, (1, 64))
    m = kiln.trace(bert, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                   buckets={"input_ids": {1: [16, 32, 64]}}, pad_values={"attention_mask": 0})
    check = m.manifest["padding_check"]
    assert check["probes"] == 3 and check["max_abs_error"] < 1e-4 and not check["skipped"]
    assert check["data"] == ["example", "standard normal", "negative-shifted, scaled"]
    short = ids[:, :5]
    with torch.no_grad():
        expected = bert(input_ids=short, attention_mask=torch.ones_like(short))
    got = m(input_ids=short, attention_mask=torch.ones_like(short))
    assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-4, rtol=1e-4)
    path = tmp_path / "b.kiln"
    m.save(path)
    assert kiln.load(path).manifest["padding_check"] == check


class SeqMean(torch.nn.Module):
    """Averages over the sequence: zero padding shrinks the mean."""

    def forward(self, x):
        return x.mean(1)


def test_a_mean_over_the_padded_axis_is_refused():
    with pytest.raises(ValidationError, match=r"padding changes the answers of SeqMean.*'x' dim 1"):
        kiln.trace(SeqMean(), torch.randn(2, 8, 4), buckets={"x": {1: [4, 8]}})


def test_padding_the_batch_dim_of_a_row_wise_model_passes():
    model = models.MLP().eval()
    m = kiln.trace(model, buckets=[torch.randn(1, 16), torch.randn(4, 16), torch.randn(8, 16)])
    assert m.manifest["padding_check"]["probes"] == 2     # sizes 2 (bucket 4) and 5 (bucket 8)


def test_validate_false_skips_the_check():
    m = kiln.trace(SeqMean(), torch.randn(2, 8, 4), buckets={"x": {1: [4, 8]}}, validate=False)
    assert "padding_check" not in m.manifest


class RowsInteract(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.lin(x)
        return y - y.mean(0)    # each row depends on the others


@pytest.mark.parametrize("batch", [1, 4])
def test_dynamic_batch_of_a_model_whose_rows_interact_is_refused(batch):
    with pytest.raises(ValidationError, match=r"dynamic batch changes the answers of RowsInteract"):
        kiln.trace(RowsInteract().eval(), torch.randn(batch, 8), dynamic_batch=True)


def test_dynamic_batch_of_a_row_wise_model_records_the_check():
    model = models.MLP().eval()
    m = kiln.trace(model, torch.randn(4, 16), dynamic_batch=True)
    assert m.manifest["batch_check"]["rows"] == 5
    assert m.manifest["batch_check"]["max_abs_error"] < 1e-4
    x = torch.randn(7, 16)
    with torch.no_grad():
        assert_close(m(x), model(x))


class FixedBatch(torch.nn.Module):
    """Hard-wires its batch size: eager cannot run other sizes, so there is nothing to compare."""

    def forward(self, x):
        return x.reshape(4, -1).sum(1)


def test_a_batch_eager_cannot_run_at_any_other_size_is_refused_or_recorded_as_skipped():
    # dynamic_batch=True asks for splitting; eager runs no other batch size, so nothing proves it
    with pytest.raises(ValidationError, match=r"dynamic batch cannot be checked for FixedBatch: eager "
                                              r"PyTorch fails on every other batch size tried \(5, 6, 1, 2 rows"):
        kiln.trace(FixedBatch(), torch.randn(4, 3), dynamic_batch=True)
    m = kiln.trace(FixedBatch(), torch.randn(4, 3))           # the row check of every trace: recorded
    assert "eager failed on 5, 6, 1, 2 rows" in m.manifest["row_check"]["skipped"]
    with pytest.raises(kiln.InputError, match="could not check at trace time"):
        kiln.dynamic_batch(m)(torch.randn(8, 3))


class SeqMax(torch.nn.Module):
    """Max over the sequence: zero padding is invisible on an all-positive example only."""

    def forward(self, x):
        return x.amax(1)


def test_padding_is_checked_on_synthetic_data_besides_the_example():
    # torch.rand's example is all positive, so its padded max equals eager's (0.0 off); an
    # input with negative values at length 5 was 0.79 off. The normal probes catch it.
    with pytest.raises(ValidationError, match=r"padding changes the answers of SeqMax.*standard normal") as err:
        kiln.trace(SeqMax(), torch.rand(1, 8, 16), buckets={"x": {1: [4, 8]}})
    assert err.value.metrics["data"] == "standard normal"


class BatchMax(torch.nn.Module):
    """Rows interact through a max over the batch, clamped at 1: invisible on rand's rows."""

    def forward(self, x):
        return x / x.amax(0, keepdim=True).clamp(min=1.0)


def test_dynamic_batch_is_checked_on_synthetic_data_besides_the_example():
    with pytest.raises(ValidationError, match=r"dynamic batch changes the answers of BatchMax"):
        kiln.trace(BatchMax(), torch.rand(2, 8), dynamic_batch=True)


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x)


class Drop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.lin(x))


def test_the_checks_run_eager_in_eval_mode_and_leave_the_model_as_it_was():
    # Capture traces eval mode; the checks ran the model in its own training mode: batch norm
    # on batch statistics (a false refusal, and its running stats moved), dropout at random.
    bn = Norm().train()
    m = kiln.trace(bn, torch.randn(4, 8) * 3 + 2, dynamic_batch=True)
    assert "max_abs_error" in m.manifest["batch_check"]
    assert bn.training and bn.bn.training and bn.bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.bn.running_mean, torch.zeros(8))
    drop = Drop().train()
    m = kiln.trace(drop, torch.randn(1, 8, 8), buckets={"x": {1: [4, 8]}})
    assert m.manifest["padding_check"]["probes"] == 2
    assert drop.training and drop.drop.training


class Packed(torch.nn.Module):
    """Packed sequences: token i attends to token j only where seg[i] == seg[j] (segment ids, no mask)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, seg):
        a = self.q(x) @ self.k(x).transpose(1, 2)
        a = a.masked_fill(seg[:, :, None] != seg[:, None, :], float("-inf")).softmax(-1)
        return a @ self.v(x)


def test_an_integer_input_padded_with_one_of_its_real_values_is_refused():
    # Segment ids padded with 0: real tokens of segment 0 attend to the padding. The example's
    # ids are 1 and 2, and the probes kept them, so the check passed and seg=[0,0,0,1,1] was
    # 0.56 off. The synthetic probes now give such inputs real 0s.
    model = Packed().eval()
    x, seg = torch.randn(1, 8, 8), torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    with pytest.raises(ValidationError, match=r"Integer input 'seg'.*pad_values=\{'seg': -1\}"):
        kiln.trace(model, {"x": x, "seg": seg}, buckets={"x": {1: [4, 8]}})
    m = kiln.trace(model, {"x": x, "seg": seg}, buckets={"x": {1: [4, 8]}}, pad_values={"seg": -1})
    for s in ([0, 0, 0, 1, 1], [0, 0, 1], [3, 3, 3, 3, 3]):
        xi, si = torch.randn(1, len(s), 8), torch.tensor([s])
        with torch.no_grad():
            assert_close(m(x=xi, seg=si), model(xi, si), atol=1e-5, rtol=1e-5)


def test_the_example_probe_is_the_users_example_never_its_padding():
    # An example shorter than the largest bucket was padded up to it, and the probe narrowed
    # that: seg [1, 1, 2] became [1, 1, 2, -1, -1], real positions holding the pad value, and
    # a correct model was refused. The probe now tiles the user's own example.
    model = Packed().eval()
    x, seg = torch.randn(1, 3, 8), torch.tensor([[1, 1, 2]])
    m = kiln.trace(model, {"x": x, "seg": seg}, buckets={"x": {1: [4, 8]}}, pad_values={"seg": -1})
    assert m.manifest["padding_check"]["probes"] == 2
    xi, si = torch.randn(1, 6, 8), torch.tensor([[1, 1, 2, 2, 2, 3]])
    with torch.no_grad():
        assert_close(m(x=xi, seg=si), model(xi, si), atol=1e-5, rtol=1e-5)


class Pairs(torch.nn.Module):
    """Averages pairs of positions: eager runs even lengths only, and sees zero padding."""

    def forward(self, x):
        B, L, D = x.shape
        return x.reshape(B, L // 2, 2 * D).mean(1)


class EvenBatch(torch.nn.Module):
    """Subtracts the mean over all rows (taken in pairs): eager runs even batches only."""

    def forward(self, x):
        B, D = x.shape
        return x - x.reshape(B // 2, 2, D).mean((0, 1))


def test_padding_is_probed_at_a_size_eager_runs_when_the_shortest_one_fails():
    # Eager cannot run lengths 1 and 5 (the shortest inputs of buckets 4 and 8), so both probes
    # were skipped and the buckets accepted with 0 probes: length 2 was 1.109 off, 6 0.207.
    # The check now tries the next even lengths (2, 6), and the padding shows.
    with pytest.raises(ValidationError, match=r"padding changes the answers of Pairs: an input of size \[2\]"):
        kiln.trace(Pairs().eval(), torch.randn(2, 8, 3), buckets={"x": {1: [4, 8]}})
    with pytest.raises(ValidationError, match=r"padding changes the answers of EvenBatch.*'x' dim 0"):
        kiln.trace(EvenBatch().eval(), torch.randn(8, 3), buckets={"x": {0: [4, 8]}})


class PairSums(torch.nn.Module):
    """Sums each pair of positions in place: even lengths only, and blind to padding past them."""

    def forward(self, x):
        B, L, D = x.shape
        return x.reshape(B, L // 2, 2, D).sum(2, keepdim=True).expand(B, L // 2, 2, D).reshape(B, L, D)


def test_a_model_of_even_lengths_that_padding_cannot_change_is_probed_and_accepted():
    model = PairSums().eval()
    m = kiln.trace(model, torch.randn(2, 8, 3), buckets={"x": {1: [4, 8]}})
    check = m.manifest["padding_check"]
    assert check["probes"] == 2 and check["max_abs_error"] < 1e-5
    assert [s["sizes"] for s in check["skipped"]] == [[1], [5]]      # tried first, then 2 and 6
    for length in (2, 6):
        x = torch.randn(2, length, 3)
        assert_close(m(x), model(x), atol=1e-5, rtol=1e-5)


class Quads(torch.nn.Module):
    """Groups of four positions: eager runs no length that bucket 4 pads (1, 2, 3)."""

    def forward(self, x):
        B, L, D = x.shape
        return x.reshape(B, L // 4, 4 * D).mean(1)


def test_a_bucket_whose_padded_sizes_eager_never_runs_is_refused():
    with pytest.raises(ValidationError) as err:
        kiln.trace(Quads().eval(), torch.randn(2, 8, 3), buckets={"x": {1: [4, 8]}})
    msg = str(err.value)
    assert "padding cannot be checked for Quads" in msg and "bucket [4]" in msg
    assert "[1], [2]" in msg and "'x' dim 1" in msg and "validate=False" in msg
    assert err.value.metrics["tried"] == [[1], [2]]
