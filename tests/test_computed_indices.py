"""An index the graph computes (kiln.graph.computed_indices): proven in range when it is
compiled, or run on the host, where a bad one raises eager's error. On the old code OpenVINO
answered a row of zeros for ``index_select(t, 0, ids + 1)`` at the last id, and ONNX
Runtime read a computed -1 from the end where ``gather`` raises (12-01)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import computed_indices
from kiln.graph.capture import capture
from kiln.graph.partition import takes

ENGINES = ("openvino", "onnxruntime")


class Computed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, ids, j, k):
        shifted = self.table.index_select(0, ids + 1)                     # 10 at the last id
        mirrored = self.table.gather(0, (9 - j).view(-1, 1).expand(-1, 4))    # -1 past the last
        written = torch.zeros(10, 4).index_copy(0, k - 1, self.table[:2])     # -1 at k = 0
        return shifted, mirrored, written


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:                              # noqa: BLE001 - the error is the answer
        return e


@pytest.fixture(scope="module", params=ENGINES)
def computed(request):
    torch.manual_seed(0)
    model = Computed().eval()
    return model, kiln.trace(model, _inputs(), engine=request.param, optlevel=1, cache=False, quiet=True)


def _inputs(ids=(0, 3), j=(1, 2), k=(1, 5)):
    return torch.tensor(ids), torch.tensor(j), torch.tensor(k)


def test_a_computed_index_out_of_range_is_eagers_error_on_every_engine(computed):
    model, compiled = computed
    for good in (_inputs((8, 0), (9, 0), (10, 1)), _inputs((2, 5), (4, 4), (3, 2))):
        for got, expected in zip(compiled(*good), model(*good)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)    # rows read, exactly
    for bad in (_inputs(ids=(9, 0)),                                    # index_select of row 10
                _inputs(j=(10, 0)),                                     # gather of row -1
                _inputs(k=(0, 4))):                                     # index_copy to row -1
        expected = _outcome(model, *bad)
        assert isinstance(expected, (IndexError, RuntimeError))
        with pytest.raises(type(expected)) as got:
            compiled(*bad)
        assert str(expected) in str(got.value)


def test_the_report_says_why_a_computed_index_runs_on_the_host():
    report = str(kiln.analyze(Computed().eval(), _inputs(), engine="openvino"))
    assert "index the graph computes" in report and "aten::index_select" in report and "aten::gather" in report


def test_a_computed_index_copy_runs_on_the_host_even_for_inductor():
    """Inductor checks the indices it reads, but lowers ``index_copy`` to an ``index_put``,
    which took a computed -1 from the end and wrote the last row where eager raises (checked
    on the old code with a build; here the placement, which needs none)."""
    from kiln import engines
    gm = capture(Computed().eval(), _inputs()).graph_module
    inductor = engines.get("inductor")
    reasons = {str(n.target): takes(inductor, n) for n in gm.graph.nodes if computed_indices.indexes(n)}
    assert reasons["aten.index_copy.default"] == computed_indices.WHY_HOST
    assert reasons["aten.index_select.default"] is None and reasons["aten.gather.default"] is None


class Proven(torch.nn.Module):
    """Indices a model makes for itself, each proven in range: they stay on the engine."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(16, 4)
        self.bias = torch.nn.Embedding(4, 1)
        self.codes = torch.nn.Embedding(256, 2)

    def forward(self, ids, x, small):
        n = x.shape[1]
        positions = self.pos(torch.arange(n))                                    # arange
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]                 # T5's buckets:
        buckets = (rel.abs().float() + 1).log().long().clamp(max=3)             # a float detour
        order = x.gather(1, torch.argsort(x, dim=1))                            # argsort's positions
        wrapped = self.pos((ids * 7) % 16)                                       # a remainder
        clamped = self.pos((ids + 3).clamp(0, 15))                               # a clamp
        counted = self.pos(torch.cumsum(torch.ones_like(ids), -1) - 1)          # cumsum of ones
        mask = (ids >= 4) & (ids < 20)                                          # a vocabulary shard's
        sharded = self.pos((ids - 4) * mask.long()) * mask.unsqueeze(-1)        # rows, as NxD's layers
        kept = self.pos(torch.where((ids > -1) & (ids <= 15), ids, 0))           # and a where
        return (positions.sum() + self.bias(buckets).sum() + order.sum() + wrapped.sum() + clamped.sum()
                + counted.sum() + self.codes((small + 1).int()).sum() + sharded.sum() + kept.sum())      # uint8 wraps: 0..255


def _proven_inputs():
    return torch.tensor([[3, 40, -7]]), torch.randn(2, 5), torch.tensor([0, 255], dtype=torch.uint8)


def test_indices_a_model_makes_for_itself_are_proven_and_stay_on_the_engine():
    gm = capture(Proven().eval(), _proven_inputs()).graph_module
    assert computed_indices.unproven(gm) == set()
    report = kiln.analyze(Proven().eval(), _proven_inputs(), engine="openvino")
    assert "index the graph computes" not in str(report)


@pytest.mark.parametrize("build, ids", [
    (lambda ids: ids + 1, torch.arange(12)),                                   # an input moved: unknown
    (lambda ids: (ids.to(torch.uint8) + 250).long(), torch.arange(6, 18)),     # wraps to 0..11; 0..255 known
    (lambda ids: (ids % 16) - 8, torch.arange(8, 16)),                         # -8..7 for all it knows
    (lambda ids: ids.max() - ids, torch.arange(12)),                          # 0..11 here: unknown
    (lambda ids: (ids - 4) * ((ids >= 4) & (ids < 21)).long(), torch.arange(12)),  # a shard one too wide
    (lambda ids: (ids - 4) * ((ids >= 4) | (ids < 20)).long(), torch.arange(4, 16)),  # | bounds nothing
])
def test_what_the_analysis_cannot_prove_is_left_unproven(build, ids):
    """Each index is in range for these example values, and the analysis cannot know it."""
    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(16, 2))

        def forward(self, ids):
            return self.table[build(ids).clamp(max=10 ** 6)].sum() + self.table.index_select(0, build(ids)).sum()
    gm = capture(Pick().eval(), (ids,)).graph_module
    unproven = computed_indices.unproven(gm)
    assert any(n.target is torch.ops.aten.index_select.default for n in unproven)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_device_raises_eagers_error_for_a_computed_index(engine):
    """A device program built by an engine that answers a computed index out of range (here
    forced: OpenVINO or ONNX Runtime) runs that operation on the host: a bad one is eager's
    error, good ones eager's rows."""
    from kiln.device import metrics, modes
    dev = modes.device()
    metrics.clear()
    modes.forget_compiled()
    modes.set_mode("lazy", background=False, engine=engine)
    weight = torch.randn(6, 3)

    def f(ids, w):
        return F.embedding(ids + 1, w) * 2

    def step(ids):
        out = f(torch.tensor(ids).to(dev), weight.to(dev))
        modes.mark_step()
        return out.cpu()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)          # every program compiled
            for ids in ([0, 4], [0, 5], [-2, 1], [1, 2]):   # 6 and -1: out of range
                expected = _outcome(f, torch.tensor(ids), weight)
                if isinstance(expected, Exception):
                    with pytest.raises(type(expected), match="index out of range"):
                        step(ids)
                else:
                    torch.testing.assert_close(step(ids), expected, rtol=0, atol=0)
        assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") == 1
    finally:
        modes.wait_compiles()
        modes.set_mode("eager", background="auto", engine=None)
