"""An index out of range reaches no engine: eager PyTorch raises IndexError for it, OpenVINO
answered zeros (a token id beyond the vocabulary embedded as a row of zeros), and an
AOTInductor kernel's bounds check ended the process (it is an error now:
kiln.engines.inductor_bounds). The compile records the range each indexing input has
(kiln.graph.index_ranges); every call checks it first. Indices the graph computes:
tests/test_computed_indices.py."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph.capture import capture
from kiln.graph.index_ranges import input_ranges
from kiln import IndexRangeError


class Lookups(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids, rows, x, cols):
        return (self.table(ids).sum(-1) * x.index_select(0, rows).sum() + x[:, cols].sum(0)
                + x.gather(1, rows.view(-1, 1).expand(-1, 2)).sum())


def _inputs(ids=(1, 9), rows=(0, 2), cols=(0, -5)):
    return (torch.tensor([list(ids)]), torch.tensor(list(rows)), torch.arange(15.).view(3, 5), torch.tensor(list(cols)))


def test_the_ranges_are_eagers_and_only_for_values_an_index_reads_unchanged():
    class Guarded(torch.nn.Module):
        def forward(self, ids, x):
            return x.index_select(0, ids.view(-1).clamp(0, 2)).sum() + x[ids.view(-1).long()].sum()
    ranges = input_ranges(capture(Lookups().eval(), _inputs()).graph_module)
    # embedding from 0; index_select and gather from 0 (rows reads both: the narrower); x[:, i]
    # from -size; the float input none
    assert ranges == {0: (0, 10, "embedding", None), 1: (0, 3, "index_select", None), 3: (-5, 5, "indexing", None)}
    # a clamped index is not the input's values: only the plain read limits the input
    guarded = input_ranges(capture(Guarded(), (torch.tensor([[0, 1]], dtype=torch.int32), torch.randn(3, 2))).graph_module)
    assert guarded == {0: (-3, 3, "indexing", None)}


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.table(ids) * 2


def test_an_index_out_of_range_is_refused_before_any_engine():
    """ONNX Runtime raised an error of its own; OpenVINO answered a row of zeros; an
    AOTInductor build ended the process (checked by hand on the old code: "terminate called
    after throwing an instance of 'c10::Error'"; an Inductor build costs ~9 s of the suite,
    and the check that prevents it runs before any engine, as here)."""
    model = Lookups().eval()
    compiled = kiln.trace(model, _inputs(), engine="onnxruntime", optlevel=1, cache=False, quiet=True)
    for good in (_inputs(), _inputs(ids=(0, 0), rows=(2, 1), cols=(4, -1))):
        torch.testing.assert_close(compiled(*good), model(*good), rtol=1e-5, atol=1e-5)
    for bad, name, value in ((_inputs(ids=(1, 10)), "ids", 10), (_inputs(ids=(-1, 2)), "ids", -1),
                             (_inputs(rows=(0, 3)), "rows", 3), (_inputs(cols=(0, -6)), "cols", -6)):
        with pytest.raises(IndexError):
            model(*bad)                                              # eager's answer
        with pytest.raises(IndexRangeError, match=f"input '{name}' holds {value}, out of range") as e:
            compiled(*bad)
        assert isinstance(e.value, IndexError)
    assert [t.get("range") for t in compiled.manifest["inputs"]["tensors"]] == \
        [[0, 10, "embedding"], [0, 3, "index_select"], None, [-5, 5, "indexing"]]

    embed = Embed().eval()
    on_openvino = kiln.trace(embed, (torch.tensor([[1, 9]]),), engine="openvino", optlevel=1, cache=False, quiet=True)
    assert [p["engine"] for p in on_openvino.manifest["partitions"]] == ["openvino"]
    torch.testing.assert_close(on_openvino(torch.tensor([[3, 0]])), embed(torch.tensor([[3, 0]])))
    with pytest.raises(IndexRangeError, match="input 'ids' holds 12"):
        on_openvino(torch.tensor([[1, 12]]))                         # zeros for that row, before


def test_a_bucketed_model_checks_the_ranges_every_bucket_shares():
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(10, 4)

        def forward(self, ids, pick):
            h = self.table(ids)                  # [1, L, 4]: the vocabulary is every bucket's
            return h[:, pick].sum(-1)            # a pick into L: its range grows with the bucket
    model = Tokens().eval()
    compiled = kiln.trace(model, (torch.tensor([[1, 2, 3, 4]]), torch.tensor([0, 3])), buckets={"ids": {1: [4, 8]}},
                          optlevel=1, cache=False, quiet=True)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    torch.testing.assert_close(compiled(ids, torch.tensor([0, 5])), model(ids, torch.tensor([0, 5])))
    with pytest.raises(IndexRangeError, match="input 'ids' holds 12"):
        compiled(torch.tensor([[1, 12, 3]]), torch.tensor([0, 1]))


def test_the_device_refuses_a_bad_index_before_its_program_runs():
    """On the device, a program whose engine answers zeros (OpenVINO) for an id beyond the
    table raises eager's IndexError instead, and runs compiled at the next good step; the
    same check kept an Inductor program from ending the process (checked by hand: old code,
    "terminate called after throwing an instance of 'c10::Error'")."""
    import warnings

    from kiln.device import metrics, modes
    dev = modes.device()
    metrics.clear()
    modes.forget_compiled()
    modes.set_mode("lazy", background=False, engine="openvino")
    weight = torch.randn(6, 3)

    def step(ids):
        out = (F.embedding(torch.tensor(ids).to(dev), weight.to(dev)) * 2).sum()
        modes.mark_step()
        return out.item()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)          # every program compiled
            for ids in ([0, 5], [0, 9], [1, 2]):
                if ids[1] < 6:
                    assert step(ids) == pytest.approx(float((F.embedding(torch.tensor(ids), weight) * 2).sum()))
                    continue
                with pytest.raises(IndexError, match="index out of range in self"):
                    step(ids)
        assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") == 1
        assert metrics.counter_value("CompiledRunFailed") == 0
    finally:
        modes.wait_compiles()
        modes.set_mode("eager", background="auto", engine=None)


def test_an_input_read_through_a_slice_or_a_gather_is_checked_whole():
    """``emb(ids[:, 1:])`` and an ``index_copy`` at input positions: on the old code the
    slice left ``ids`` unchecked (OpenVINO answered a row of zeros for id 10) and
    ``index_copy``'s positions were not an indexing input at all."""
    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(10, 4)

        def forward(self, ids, pos, rows):
            return self.table(ids[:, 1:]).sum(-1), torch.zeros(5, 2).index_copy(0, pos, rows)
    model = Sliced().eval()
    example = (torch.tensor([[0, 1, 2]]), torch.tensor([0, 3]), torch.ones(2, 2))
    assert input_ranges(capture(model, example).graph_module) == {0: (0, 10, "embedding", None),
                                                                  1: (0, 5, "index_copy", None)}
    compiled = kiln.trace(model, example, engine="openvino", cache=False, quiet=True)
    good = (torch.tensor([[0, 9, 4]]), torch.tensor([4, 1]), torch.randn(2, 2))
    for got, expected in zip(compiled(*good), model(*good)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexRangeError, match="'ids' holds 10"):
        compiled(torch.tensor([[0, 10, 4]]), *good[1:])
    with pytest.raises(IndexRangeError, match="'pos' holds 5"):
        compiled(good[0], torch.tensor([5, 0]), good[2])


def test_a_malformed_range_in_a_manifest_is_a_clear_artifact_error():
    from kiln.artifact import schema
    from kiln.errors import ArtifactError
    spec = {"name": "ids", "shape": [1, 2], "dtype": "int64", "range": [0, 10, "embedding"]}
    assert schema.check_specs(schema.Fail("m.kiln"), [spec], "inputs.tensors") == [spec]
    for bad in ([0, "10", "embedding"], [10, 0, "embedding"], [0, 10], "0:10"):
        with pytest.raises(ArtifactError, match=r"inputs.tensors\[0\].range .*corrupt or was edited"):
            schema.check_specs(schema.Fail("m.kiln"), [dict(spec, range=bad)], "inputs.tensors")


def test_a_losss_targets_may_hold_its_ignore_index_and_nothing_else_out_of_range():
    """``cross_entropy`` gathers its targets after masking ``ignore_index`` out
    (``where(t != k, t, 0)``): a target must be a class or ``k``. A label beyond the classes
    ended a process whose loss ran on Inductor; on ONNX Runtime it is refused like any index."""
    class Loss(torch.nn.Module):
        def forward(self, x, t, u):
            return F.cross_entropy(x, t, reduction="none") + F.cross_entropy(x, u, ignore_index=-1, reduction="none")
    x = torch.randn(3, 5)
    args = (x, torch.tensor([0, -100, 4]), torch.tensor([2, -1, 1]))
    c = kiln.trace(Loss(), args, engine="onnxruntime", optlevel=1, cache=False, quiet=True)
    assert [t.get("range") for t in c.manifest["inputs"]["tensors"]] == \
        [None, [0, 5, "gather", -100], [0, 5, "gather", -1]]
    for t, u in (([0, -100, 4], [2, -1, 1]), ([-100, -100, -100], [-1, -1, 0])):
        args = (x, torch.tensor(t), torch.tensor(u))
        torch.testing.assert_close(c(*args), Loss()(*args))
    for t, u, bad in (([0, 5, 4], [2, 0, 1], 5), ([0, 1, 4], [2, -100, 1], -100)):
        with pytest.raises(IndexError):
            Loss()(x, torch.tensor(t), torch.tensor(u))
        with pytest.raises(IndexRangeError, match=f"holds {bad}, out of range"):
            c(x, torch.tensor(t), torch.tensor(u))
