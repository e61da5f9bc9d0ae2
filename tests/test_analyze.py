"""kiln.analyze: op support report without compiling."""
import torch

import kiln
from tests import models


def test_report_contents_with_unsupported_op():
    model, x = models.custom_op()
    rep = kiln.analyze(model, x)
    d = rep.to_dict()
    assert d["engine"] == "onnxruntime"
    assert d["total_ops"] == 6  # 2x(permute, addmm), relu, odd_scale
    assert d["supported_ops"] == {"aten::permute": 2, "aten::addmm": 2, "aten::relu": 1}
    assert abs(d["support_percentage"] - 100 * 5 / 6) < 0.01
    (u,) = d["unsupported_ops"]
    assert u["op"] == "kilntest::odd_scale" and u["count"] == 1
    assert "registry" in u["reason"]
    assert any("models.py" in loc and "odd_scale(h)" in loc for loc in u["locations"])
    assert [p["num_ops"] for p in d["partitions"]] == [3, 2]
    text = str(rep)
    assert "kilntest::odd_scale" in text and "are supported" in text


def test_supported_set_comes_from_exporter_registry():
    """An op is supported exactly when torch's ONNX exporter registry translates it."""
    from kiln.engines.onnxruntime import _registry
    reg = _registry()
    model, x = models.cnn()
    rep = kiln.analyze(model, x)
    for op in rep.supported_ops:
        ns, name = op.split("::")
        packet = getattr(getattr(torch.ops, ns), name.split(".")[0])
        assert any(reg.is_registered(getattr(packet, o)) for o in packet.overloads())
    assert rep.support_percentage == 100.0


def test_bert_fully_supported():
    rep = kiln.analyze(models.tiny_bert(), models.bert_inputs())
    assert rep.support_percentage == 100.0
    assert len(rep.partitions) == 1
    assert rep.supported_ops["aten::addmm"] >= 4
    assert rep.supported_ops["aten::scaled_dot_product_attention"] == 2   # kept whole, one per layer
