"""Bucketed models' inputs: indices into a bucketed dim, pad values, empty dynamic batches and
the messages that describe bucketed shapes."""
import pytest
import torch

import kiln

H = 8


class Gather(torch.nn.Module):
    """Picks one position per row of the bucketed dim: ``pos`` indexes a padded dim."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x, pos):
        return self.lin(x)[torch.arange(x.shape[0]), pos]


@pytest.fixture(scope="module")
def gather():
    model = Gather().eval()
    compiled = kiln.trace(model, {"x": torch.randn(2, 8, H), "pos": torch.tensor([1, 3])},
                          buckets={"x": {1: [4, 8]}})
    return model, compiled


def _eager(model, *args):
    with torch.no_grad():
        return model(*args)


def test_an_index_into_a_bucketed_dim_is_checked_against_the_actual_length(gather):
    # With x of length 5 padded to 8: pos=6 answered a padding row and pos=9 raised ONNX
    # Runtime's raw GatherND error; eager raises IndexError for both.
    model, compiled = gather
    x = torch.randn(2, 5, H)
    for bad in (6, 9, 5, -6):
        pos = torch.tensor([1, bad])
        with pytest.raises(IndexError):
            _eager(model, x, pos)
        with pytest.raises(kiln.IndexRangeError, match=rf"'pos' holds {bad}.*dimension of 5"):
            compiled(x=x, pos=pos)
    loaded = kiln.load(compiled.to_bytes())
    with pytest.raises(kiln.IndexRangeError, match="dimension of 5"):
        loaded(x=x, pos=torch.tensor([1, 6]))


def test_a_negative_index_into_a_bucketed_dim_counts_from_the_callers_end(gather):
    # -1 is the last real position; after padding it was the last padding row
    model, compiled = gather
    x = torch.randn(2, 5, H)
    for pos in ([1, -1], [-5, 4], [0, 3]):
        pos = torch.tensor(pos)
        torch.testing.assert_close(compiled(x=x, pos=pos), _eager(model, x, pos), atol=1e-5, rtol=1e-5)
    x8 = torch.randn(2, 8, H)   # an exact bucket: nothing padded
    pos = torch.tensor([7, -8])
    torch.testing.assert_close(compiled(x=x8, pos=pos), _eager(model, x8, pos), atol=1e-5, rtol=1e-5)


def test_dynamic_batch_over_buckets_checks_every_rows_index(gather):
    model, compiled = gather
    dyn = kiln.dynamic_batch(compiled)
    x, pos = torch.randn(3, 5, H), torch.tensor([1, 2, 4])
    torch.testing.assert_close(dyn(x, pos), _eager(model, x, pos), atol=1e-5, rtol=1e-5)
    with pytest.raises(kiln.IndexRangeError, match="'pos' holds 6"):
        dyn(x, torch.tensor([1, 2, 6]))


def test_an_empty_batch_over_buckets_has_the_callers_lengths(gather):
    # 0 rows at length 5 came back as (0, 4, 8): the first variant's output shape
    _, compiled = gather
    x = torch.randn(2, 8, H)
    seq = kiln.trace(torch.nn.Linear(H, H).eval(), x, buckets={"input": {1: [4, 8]}})
    dyn = kiln.dynamic_batch(seq)
    for n in (1, 3, 5, 8):
        assert dyn(torch.randn(0, n, H)).shape == (0, n, H)
    with pytest.raises(kiln.InputError, match="larger than the largest bucket"):
        dyn(torch.randn(0, 9, H))
    assert kiln.dynamic_batch(compiled)(torch.randn(0, 5, H), torch.zeros(0, dtype=torch.long)).shape == (0, H)


def test_unknown_pad_values_names_are_an_error():
    # a misspelt name was ignored (recorded {}), padding that input with 0
    model = torch.nn.Linear(H, H).eval()
    with pytest.raises(kiln.CompilerArgsError, match=r"pad_values names 'inputs'.*inputs are input"):
        kiln.trace(model, torch.randn(2, 8, H), buckets={"input": {1: [4, 8]}}, pad_values={"inputs": 1})
    with pytest.raises(kiln.CompilerArgsError, match=r"pad_values names 'attn'.*inputs are input"):
        kiln.trace(model, buckets=[torch.randn(2, 4, H), torch.randn(2, 8, H)], pad_values={"attn": 0})
    m = kiln.trace(model, torch.randn(2, 8, H), buckets={"input": {1: [4, 8]}}, pad_values={"input": 0.0})
    assert m.pad_values == {"0": 0.0}


def test_messages_show_the_bucketed_dims_range(gather):
    # "missing input 'pos'... expected (2, 4, 8) float32" quoted the smallest variant's shape
    _, compiled = gather
    x = torch.randn(2, 5, H)
    with pytest.raises(kiln.InputError, match=r"missing input 'pos': expected \(2,\) int64"):
        compiled(x=x)
    with pytest.raises(kiln.InputError, match=r"missing input 'x': expected \(2, 1\.\.8, 8\) float32"):
        compiled(pos=torch.tensor([1, 2]))
    with pytest.raises(kiln.InputError, match=r"input 'x': expected 3-d \(2, 1\.\.8, 8\) float32, got \(2, 5\) float32"):
        compiled(x=x[:, :, 0], pos=torch.tensor([1, 2]))
    with pytest.raises(kiln.InputError, match=r"input 'x': expected \(N, 1\.\.8, 8\) float32"):
        kiln.dynamic_batch(compiled)(x.double(), torch.tensor([1, 2]))
    torch.testing.assert_close(compiled(x, torch.tensor([1, 2])), compiled(x=x, pos=torch.tensor([1, 2])))


def test_a_model_failing_on_the_resized_example_names_the_bucket():
    # pos=7 fits the example (length 8), not the 4 bucket: the model's raw IndexError came
    # out of the compile with no word of the bucket
    with pytest.raises(kiln.CompilerArgsError, match=r"bucket 1/2 \('x' dim 1 narrowed from 8 to 4.*"
                       r"IndexError: index 7 is out of bounds") as err:
        kiln.trace(Gather().eval(), {"x": torch.randn(2, 8, H), "pos": torch.tensor([1, 7])},
                   buckets={"x": {1: [4, 8]}})
    assert isinstance(err.value.__cause__, IndexError)


class Shift(torch.nn.Module):
    def forward(self, x):
        return x[:, 1:] * 2


def test_an_output_dims_mapping_to_a_shorter_dim_is_refused_as_such():
    # x[:, 1:] is one shorter than the bucket: declared to follow it, it was refused as
    # "The model sees the padding"
    with pytest.raises(kiln.CompilerArgsError, match=r"output_dims maps output 'output0' dim 1.*sizes \[3, 7\]"):
        kiln.trace(Shift(), torch.randn(2, 8), buckets={"x": {1: [4, 8]}}, output_dims={"output0": {1: "x"}})
    # unsliced, no slicing gives x[:, 1:] back: said so, not "the model sees the padding"
    with pytest.raises(kiln.ValidationError, match=r"cannot give Shift's output 'output0' back.*"
                       r"answers \(2, 3\), eager \(2, 0\)"):
        kiln.trace(Shift(), torch.randn(2, 8), buckets={"x": {1: [4, 8]}}, output_dims={"output0": {1: None}})


def test_a_single_bucket_size_is_refused_saying_so():
    # it was "the bucket examples all have the same shapes; give different sizes"
    with pytest.raises(kiln.CompilerArgsError, match=r"buckets\['input'\]\[1\] has one size \(8\).*at least two"):
        kiln.trace(torch.nn.Linear(H, H).eval(), torch.randn(2, 8, H), buckets={"input": {1: [8]}})


class Scaled(torch.nn.Module):
    """``w``: 8 features per row, not a sequence, of the same size as ``x``'s length 8."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 8)

    def forward(self, x, w):
        return self.lin(x) * w.unsqueeze(1)


def test_an_input_that_follows_the_axis_by_its_size_alone_is_named_with_the_fix():
    # it said only "'w' dim 1 narrowed from 8 to 4 ... give such inputs as bucket examples of
    # their own", not why w was resized nor that naming it keeps it as given
    model = Scaled().eval()
    x, w = torch.randn(2, 8, 4), torch.randn(2, 8)
    with pytest.raises(kiln.CompilerArgsError) as err:
        kiln.trace(model, {"x": x, "w": w}, buckets={"x": {1: [4, 8]}})
    msg = str(err.value)
    assert "'w' dim 1 (size 8) was taken to follow 'x' dim 1's bucketed axis because its size matched" in msg
    assert "buckets={'x': {1: [4, 8]}, 'w': {}}" in msg
    m = kiln.trace(model, {"x": x, "w": w}, buckets={"x": {1: [4, 8]}, "w": {}})      # the fix it names
    xi, wi = torch.randn(2, 5, 4), torch.randn(2, 8)
    torch.testing.assert_close(m(x=xi, w=wi), _eager(model, xi, wi), atol=1e-5, rtol=1e-5)


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x, mask):
        return self.lin(x) * mask.unsqueeze(-1)


def test_dynamic_batch_over_buckets_names_each_problem():
    # every error began "dynamic batch: only dim 0 may differ from the compiled shapes", for a
    # dtype, a length past the largest bucket and two lengths that disagree alike
    model = Masked().eval()
    m = kiln.trace(model, {"x": torch.randn(2, 8, H), "mask": torch.ones(2, 8)},
                   buckets={"x": {1: [4, 8]}}, pad_values={"mask": 0}, dynamic_batch=True)
    x, mask = torch.randn(3, 5, H), torch.ones(3, 5)
    with pytest.raises(kiln.InputError) as err:
        m(x=x, mask=mask.bool())
    assert "input 'mask' is bool, but the model was compiled for float32" in str(err.value)
    with pytest.raises(kiln.InputError) as err:
        m(x=torch.randn(3, 9, H), mask=torch.ones(3, 9))
    assert "dim 1 is 9, larger than the largest bucket (8)" in str(err.value)
    with pytest.raises(kiln.InputError) as err:
        m(x=x, mask=torch.ones(3, 6))
    assert "'mask' dim 1 is 6 but 'x' has 5 on the same bucketed axis" in str(err.value)
    for e in (err,):
        assert "only dim 0 may differ" not in str(e.value)
    torch.testing.assert_close(m(x=x, mask=mask), _eager(model, x, mask), atol=1e-5, rtol=1e-5)


class _WithDefaults(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0):
        y = self.lin(x)
        if mask is not None:
            y = y * mask.unsqueeze(-1)
        return y * scale


def test_a_bucketed_model_takes_a_traced_default_given_explicitly():
    """Found by probing: model(x, mask=None) or scale=1.0, the defaults the example left out, were
    accepted by a plain compiled model but refused by a bucketed one as 'unexpected input'."""
    model = _WithDefaults().eval()
    compiled = kiln.trace(model, torch.randn(2, 8, 4), buckets={"x": {1: [4, 8]}}, cache=False)
    x = torch.randn(2, 5, 4)
    for given in ({"mask": None}, {"scale": 1.0}, {"scale": 1}):
        torch.testing.assert_close(compiled(x, **given), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(kiln.errors.InputError, match="scale"):
        compiled(x, scale=2.0)          # the graph holds 1.0 fixed
