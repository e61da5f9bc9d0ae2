"""kiln.engines.ort_export: a partition goes to torch's ONNX exporter as the ExportedProgram
it already is (no second trace), and the ONNX it gives is the traced path's, op for op and
answer for answer."""
import collections

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from kiln.compiler import phases  # noqa: E402
from kiln.compiler.driver import make_options  # noqa: E402
from kiln.engines import ort_export  # noqa: E402
from kiln.engines.onnxruntime import EXPORT_OPSET  # noqa: E402
from kiln.graph.capture import capture  # noqa: E402
from kiln.graph.partition import split  # noqa: E402
from kiln.progress import Progress  # noqa: E402
from kiln.runtime.program import build as build_program  # noqa: E402


def _partition():
    """The tiny Llama's decode step as one ONNX Runtime partition: int64 and bool inputs,
    the KV cache in float, weights inside, attention kept whole."""
    from kiln.llm.build import _decode_example
    from kiln.llm.decoder import DecoderStep, cache_shape
    from tests.test_llm_decoder import _model
    model = _model("llama")
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    captured = capture(step, _decode_example(cache_shape(model.config, 2, 16), 2))
    plan = phases.plan(captured, make_options(engine="onnxruntime"), Progress(quiet=True))
    fused = split(captured.graph_module, plan.placement)
    _, _, subs = build_program(fused)
    inputs, _ = phases.partition_io(fused, captured.example_inputs)
    assert len(subs) == 1
    return subs[0], inputs[0]


def _run(program, inputs):
    import onnxruntime as ort
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)})


def test_export_without_retracing_equals_the_traced_export(monkeypatch):
    from kiln.engines.onnxruntime import _registry
    sub, inputs = _partition()
    program = ort_export.program_of(sub)
    assert program is not None, "the partition should go to the exporter as an ExportedProgram"
    assert list(program.graph_signature.user_inputs) == [n.name for n in sub.graph.nodes if n.op == "placeholder"]
    weights = [n for n in sub.graph.nodes if n.op == "get_attr"]
    assert len(program.constants) == len(weights) > 0

    traced = []
    original = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: traced.append(1) or original(*a, **k))
    direct = ort_export.export(sub, inputs, opset=EXPORT_OPSET, optimize=True, registry=_registry())
    assert traced == [], "the direct path traced the partition again"
    monkeypatch.setattr(ort_export, "program_of", lambda partition: None)
    retraced = ort_export.export(sub, inputs, opset=EXPORT_OPSET, optimize=True, registry=_registry())
    assert traced, "the public path should trace the module"

    ops = [collections.Counter(n.op_type for n in p.model_proto.graph.node) for p in (direct, retraced)]
    assert ops[0] == ops[1]
    assert [i.name for i in direct.model_proto.graph.input] == [i.name for i in retraced.model_proto.graph.input]
    a, b = _run(direct, inputs), _run(retraced, inputs)
    with torch.no_grad():
        eager = sub(*inputs)
    assert len(a) == len(b) == len(eager)
    for x, y, e in zip(a, b, eager):
        assert np.array_equal(x, y)
        np.testing.assert_allclose(x, e.numpy(), atol=1e-5, rtol=1e-5)


def test_partitions_it_cannot_write_take_the_public_path():
    class PassThrough(torch.nn.Module):
        def forward(self, x):
            return x, x * 2

    gm = torch.fx.symbolic_trace(PassThrough())
    assert ort_export.program_of(gm) is None            # an output that is an input (and no vals)


def test_op_signatures_made_once_give_the_same_onnx(monkeypatch):
    """The exporter's per-op signatures are made once per schema (``_signatures_once``):
    the ONNX is byte for byte what making each afresh gives, the cache fills during an
    export, and torch's own ``from_op_schema`` is back once the export is over."""
    from onnx_ir import schemas
    from kiln.engines.onnxruntime import _registry
    sub, inputs = _partition()
    original = schemas.OpSignature.__dict__["from_op_schema"]
    made = []
    counting = classmethod(lambda cls, s: made.append(s.name) or original.__func__(cls, s))
    monkeypatch.setattr(ort_export, "_SIGNATURES", {})
    monkeypatch.setattr(schemas.OpSignature, "from_op_schema", counting)
    cached = ort_export.export(sub, inputs, opset=EXPORT_OPSET, optimize=True, registry=_registry())
    assert ort_export._SIGNATURES and len(made) == len(ort_export._SIGNATURES) < 1000
    assert schemas.OpSignature.__dict__["from_op_schema"] is counting
    once = len(made)
    monkeypatch.setattr(ort_export, "_signatures_once", lambda: __import__("contextlib").nullcontext())
    fresh = ort_export.export(sub, inputs, opset=EXPORT_OPSET, optimize=True, registry=_registry())
    assert len(made) - once > 3 * once, (once, len(made) - once)     # each emitted op asked again
    assert cached.model_proto.SerializeToString() == fresh.model_proto.SerializeToString()


class _Epsilons(torch.nn.Module):
    def forward(self, x, f):
        return x / (x.abs().sum(-1, keepdim=True) + 1e-12), x * 1.000001, f + 1e-10, f * 0.1


def test_constants_keep_their_values_through_the_export():
    """Two silent wrong answers of the export, found by probing (12-03), both within the
    check's default tolerance on the example: the exporter's optimizer dropped ``+ 1e-12``
    and ``* 1.000001`` as no-ops (a row of zeros divided by its epsilon-guarded sum came out
    NaN, eager's 0), and a float64 graph's Python numbers were rounded to float32
    (``f * 0.1`` was ``f * 0.10000000149011612``, ``f + 1e-10`` was ``f``)."""
    import kiln
    x, f = torch.randn(2, 4), torch.ones(2, dtype=torch.float64)
    compiled = kiln.trace(_Epsilons(), (x, f), engine="onnxruntime", cache=False, quiet=True)
    for given in ((x, f), (torch.zeros(2, 4), f * 3)):
        got, want = compiled(*given), _Epsilons()(*given)
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)     # zeros, not NaN
        assert torch.equal(got[1] == given[0], want[1] == given[0])          # the product moved
        torch.testing.assert_close(got[2], want[2], rtol=1e-15, atol=0)
        torch.testing.assert_close(got[3], want[3], rtol=1e-15, atol=0)
