"""--auto-cast: bf16/fp16 emulation on CPUs without native support."""
import pytest
import torch

import kiln
from kiln.graph import precision
from tests import models
from tests.conftest import assert_close


def _emulated_mlp(model, x, dtype):
    r = lambda t: t.to(dtype).float()  # noqa: E731
    l1, l2 = model.net[0], model.net[2]
    h = torch.relu(torch.addmm(r(l1.bias), r(x), r(l1.weight).t()))
    return torch.addmm(r(l2.bias), r(h), r(l2.weight).t()).detach()


@pytest.mark.skipif(precision.native("bf16"), reason="host computes bf16 natively")
def test_bf16_matmult_emulation_rounds_exactly_like_bf16():
    model, _ = models.mlp()
    x = torch.randn(64, 16)
    with pytest.warns(UserWarning, match="bf16 is emulated"):
        compiled = kiln.trace(model, x, compiler_args=["--auto-cast", "matmult",
                                                       "--auto-cast-type", "bf16"])
    out = compiled(x)
    ref = model(x).detach()
    err = (out - ref).abs().max().item()
    # bf16 keeps 8 bits of mantissa: the error is visible, but small
    assert 1e-4 < err < 5e-2
    # and it is exactly the rounding a bf16 matmul with fp32 accumulation gives
    assert_close(out, _emulated_mlp(model, x, torch.bfloat16), atol=1e-5, rtol=1e-5)
    p = compiled.manifest["precision"]
    assert p == {**p, "auto_cast": "matmult", "type": "bf16", "emulated": True, "ops_rounded": 2}
    v = compiled.manifest["validation"]
    assert v["passed"] and v["min_cosine"] > 0.999 and v["max_abs_error"] == pytest.approx(err, rel=1e-3)
    assert any("emulated" in n for n in compiled.report["notes"])


def test_fp16_all_is_closer_than_bf16():
    model, _ = models.mlp()
    x = torch.randn(64, 16)
    ref = model(x).detach()
    errs = {}
    for t in ("bf16", "fp16"):
        with pytest.warns(UserWarning):
            c = kiln.trace(model, x, compiler_args=f"--auto-cast all --auto-cast-type {t}")
        errs[t] = (c(x) - ref).abs().max().item()
    assert 0 < errs["fp16"] < errs["bf16"]   # fp16 has 3 more mantissa bits


def test_fp32_and_none_change_nothing():
    model, x = models.mlp()
    c = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type fp32")
    assert "precision" not in c.manifest
    assert_close(c(x), model(x).detach(), atol=1e-6, rtol=1e-6)


def test_auto_cast_gate_failure_reports_numbers():
    model, x = models.mlp()
    with pytest.raises(kiln.ValidationError, match=r"cosine similarity 0\.9\d+ < 0\.99999999"):
        with pytest.warns(UserWarning):
            kiln.trace(model, torch.randn(64, 16), compiler_args="--auto-cast all --auto-cast-type bf16",
                       min_cosine=0.99999999)


def test_native_bf16_hosts_compute_on_openvino(monkeypatch):
    """On a CPU with native bf16 the work goes to the engine that computes it, unemulated."""
    pytest.importorskip("openvino")
    from kiln.engines import openvino as ov_backend
    from kiln.host import target
    monkeypatch.setattr(target, "native", lambda t: t == "bf16")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type bf16",
                          atol=5e-2, rtol=5e-2)
    assert compiled.manifest["precision"]["emulated"] is False
    assert {p["engine"] for p in compiled.manifest["partitions"]} == {"openvino"}
    assert ov_backend._precision(kiln.compiler.driver.make_options("--auto-cast matmult")) == "bf16"
