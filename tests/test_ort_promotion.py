"""kiln.engines.ort_promotion: the ONNX exporter's type-promotion pass (a fake-tensor re-run of
the whole graph) runs on a graph where some node needs a cast, and only there; either way
the model ONNX Runtime gets is the one the pass would have made."""
import pytest
import torch

import kiln
from kiln.engines import ort_promotion

pytest.importorskip("onnxruntime")


class Mixed(torch.nn.Module):
    """Operands ONNX's operators refuse as they are: a float plus an int64 tensor, an int64
    division that is a float one in PyTorch, an int64 times a float number."""

    def forward(self, x, i):
        return torch.tanh(x + i), torch.div(i, 2), i * 0.5


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2.0 + 1.0


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


def _graph(module, *args):
    return torch.export.export(module, args).run_decompositions().graph_module


def test_only_a_graph_with_a_node_to_cast_needs_the_pass():
    x, i = torch.randn(2, 8), torch.arange(16).reshape(2, 8)
    assert ort_promotion.needs_promotion(_graph(Mixed(), x, i))
    assert not ort_promotion.needs_promotion(_graph(Plain(), x))
    # an int number added to a float tensor: the pass writes it as a float scalar tensor
    assert ort_promotion.needs_promotion(_graph(torch.nn.Sequential(Plain(), _AddOne()), x))
    # a node whose types were not recorded: the pass runs
    gm = _graph(Plain(), x)
    next(n for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default).meta.pop("val")   # relu's input
    assert ort_promotion.needs_promotion(gm)


@pytest.mark.parametrize("always", [False, True], ids=["where-needed", "always"])
def test_mixed_types_compile_on_onnx_runtime_and_equal_eager(always, monkeypatch):
    if always:                  # the exporter's pass on every graph: the same answers
        monkeypatch.setattr(ort_promotion, "needs_promotion", lambda gm: True)
    model, x, i = Mixed().eval(), torch.randn(2, 8), torch.arange(16).reshape(2, 8)
    compiled = kiln.trace(model, (x, i), engine="onnxruntime", optlevel=1, cache=False, quiet=True,
                          fallback=False)
    assert {p["engine"] for p in compiled.manifest["partitions"]} == {"onnxruntime"}
    for got, want in zip(compiled(x, i), model(x, i)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_skipping_the_pass_writes_the_same_onnx_bytes(monkeypatch):
    """Where no node needs a cast the pass would change nothing: the exported model is the
    same, byte for byte, as with the pass run."""
    from kiln.engines import ort_export
    from kiln.engines.onnx_model import EXPORT_OPSET
    from kiln.graph.capture import capture
    x = torch.randn(2, 8)
    partition = capture(Plain().eval(), (x,)).graph_module        # what an engine is given

    def exported():
        program = ort_export.export(partition, (x,), opset=EXPORT_OPSET, optimize=False,
                                    registry=ort_export.registry_for(EXPORT_OPSET))
        return program.model_proto.SerializeToString()
    asked, real = [], ort_promotion.needs_promotion
    monkeypatch.setattr(ort_promotion, "needs_promotion", lambda gm: asked.append(real(gm)) or asked[-1])
    skipped = exported()
    assert asked == [False]                         # the pass was skipped
    monkeypatch.setattr(ort_promotion, "needs_promotion", lambda gm: True)
    assert exported() == skipped
