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


def _emulating(monkeypatch):
    """A CPU without native bf16/fp16 (where kiln warns that it emulates them), whatever
    this machine has: the tests below are about that path."""
    from kiln.host import target
    monkeypatch.setattr(target, "native", lambda t: False)


def test_fp16_all_is_closer_than_bf16(monkeypatch):
    _emulating(monkeypatch)
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


def test_auto_cast_gate_failure_reports_numbers(monkeypatch):
    _emulating(monkeypatch)
    model, x = models.mlp()
    with pytest.raises(kiln.ValidationError, match=r"cosine similarity 0\.9\d+ < 0\.99999999"):
        with pytest.warns(UserWarning):
            kiln.trace(model, torch.randn(64, 16), compiler_args="--auto-cast all --auto-cast-type bf16",
                       min_cosine=0.99999999)


class _BigAndSmall(torch.nn.Module):
    """A large output and a small one that bf16 wrecks: (x + 1000) @ ones - 1000 * 32 is
    x.sum(-1) in fp32, and noise once x + 1000 is rounded to bf16 (ulp 8)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        w = torch.ones(32, 1)
        return self.lin(x) * 1000, (x + 1000) @ w - (x * 0 + 1000) @ w


def test_auto_cast_gate_judges_each_output_on_its_own(monkeypatch):
    """The gate took the cosine over all float outputs concatenated, so the large output
    hid the wrecked small one (0.87 on OpenVINO's native bf16) and the compile passed."""
    _emulating(monkeypatch)
    torch.manual_seed(0)
    model = _BigAndSmall().eval()
    with pytest.raises(kiln.ValidationError, match=r"cosine similarity \S+ < 0\.99 \(mean .*\) on output '\[1\]'") as e:
        with pytest.warns(UserWarning):
            kiln.trace(model, torch.randn(4, 32), compiler_args="--auto-cast matmult --auto-cast-type bf16",
                       min_top1=0.0, cache=False)
    # outputs are named as the artifact's output specs name them (a tuple's by position)
    assert e.value.metrics["min_cosine_output"] == "[1]"
    assert [o["name"] for o in e.value.metrics["outputs"]] == ["[0]", "[1]"]


def test_the_gate_holds_every_classifier_and_integer_output_to_top1():
    """top-1 was checked on the first float output only, integer outputs never."""
    from kiln.graph.validation import quality_gate
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    flipped = logits.flip(1)
    ids = torch.tensor([0, 1, 0, 1])
    v = quality_gate([([logits, logits, ids], [logits, logits, ids])], 0.0, 0.99, "m")
    assert v["passed"] and v["top1_agreement"] == 1.0 and v["min_cosine"] == 1.0
    with pytest.raises(kiln.ValidationError, match=r"top-1 agreement 0\.0000 < 0\.99 on output 'b' \(0/4\)"):
        quality_gate([([logits, logits, ids], [logits, flipped, ids])], -1.0, 0.99, "m", names=["a", "b", "c"])
    with pytest.raises(kiln.ValidationError, match=r"integer output 'output2' agrees with eager on 3/4") as e:
        quality_gate([([logits, logits, ids], [logits, logits, torch.tensor([0, 1, 0, 0])])], 0.99, 0.99, "m")
    assert e.value.metrics["outputs"][2] == {"name": "output2", "agreement": 0.75}
    # one near-tie flipping in 100 rows passes, as top-1 does
    many = torch.arange(100) % 3
    assert quality_gate([([many], [torch.where(torch.arange(100) == 7, 2, many)])], 0.99, 0.99, "m")["passed"]
    # an output equal to eager's is cosine 1 even all zeros; NaN where eager has none fails
    zero = torch.zeros(3)
    assert quality_gate([([zero], [zero])], 0.99, 0.99, "m")["min_cosine"] == 1.0
    with pytest.raises(kiln.ValidationError, match="cosine similarity nan"):
        quality_gate([([logits, torch.ones(3)], [logits, torch.tensor([1.0, float("nan"), 1.0])])], 0.99, 0.0, "m")


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


# -- --auto-cast-type tf32: NVIDIA GPUs only -------------------------------------------------

from types import SimpleNamespace   # noqa: E402

from kiln.compiler import driver, options, phases, selection   # noqa: E402
from kiln.errors import CompilerArgsError   # noqa: E402
from kiln.host import tf32   # noqa: E402

TF32_ARGS = "--auto-cast matmult --auto-cast-type tf32"


def test_tf32_is_accepted_for_cuda(monkeypatch):
    assert options.parse_compiler_args(TF32_ARGS) == {"auto_cast": "matmult", "auto_cast_type": "tf32"}
    monkeypatch.setattr(selection, "cuda_available", lambda: True)
    for device in ("cuda", "auto"):
        opts = driver.make_options(TF32_ARGS, device=device)
        assert opts.device == "cuda" and options.asks_tf32(opts)
        assert not options.lossy(opts)          # held to eager at TF32's precision, not to the gate
        assert options.tf32_ops(opts) == {"conv": True, "matmul": True}
    assert options.tf32_ops(driver.make_options(device="cuda")) is None    # torch's flags decide


def test_tf32_on_a_cpu_is_an_error_that_names_the_flag_and_why(monkeypatch):
    monkeypatch.setattr(selection, "cuda_available", lambda: False)
    for device in ("cpu", "auto"):           # auto without a GPU is the CPU
        with pytest.raises(CompilerArgsError, match=r"--auto-cast-type tf32 is not supported on CPUs: "
                                                    r"TF32 is the fp32 format of NVIDIA tensor cores"):
            driver.make_options(TF32_ARGS, device=device)
    with pytest.raises(CompilerArgsError, match="fp8_e4m3 is not supported"):
        driver.make_options("--auto-cast matmult --auto-cast-type fp8_e4m3", device="cpu")


def test_tf32_auto_cast_leaves_the_graph_and_records_the_precision(monkeypatch):
    model, x = models.cnn()
    captured = kiln.graph.capture.capture(model, (x,))
    before = captured.graph_module.code
    opts = options.CompileOptions(auto_cast="matmult", auto_cast_type="tf32", device="cuda")
    monkeypatch.setattr(tf32, "computed_here", lambda: True)
    same, record = phases.apply_auto_cast(captured, opts, [])
    assert same is opts and captured.graph_module.code == before
    assert record["type"] == "tf32" and record["emulated"] is False and "TF32" in record["note"]
    monkeypatch.setattr(tf32, "computed_here", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    with pytest.raises(CompilerArgsError, match=r"tf32 needs TF32 tensor cores .*Tesla V100"):
        phases.apply_auto_cast(captured, opts, [])


def _checked(opts, record, error):
    """driver.check on a stand-in for a build of the CNN whose answers are ``error`` times
    eager's largest output off eager's."""
    model, x = models.cnn()
    captured = kiln.graph.capture.capture(model, (x,))
    scale = max(e.abs().max().item() for e in captured.eager_outputs)
    manifest = {"report": {"notes": []}}
    compiled = SimpleNamespace(manifest=manifest,
                               run_flat=lambda flat: [e + error * scale for e in captured.eager_outputs])
    plan = SimpleNamespace(options=opts, captured=captured, precision=record)
    driver.check(compiled, plan, [], kiln.progress.Progress(quiet=True))
    return manifest


def test_the_check_of_a_tf32_gpu_build_uses_the_tf32_rule_and_says_so(monkeypatch):
    monkeypatch.setattr(tf32, "computed_here", lambda: True)
    tight = {"atol": 1e-5, "rtol": 1e-5}           # the CNN's outputs are below 0.5
    opts = options.CompileOptions(auto_cast="matmult", auto_cast_type="tf32", device="cuda", **tight)
    record = {"auto_cast": "matmult", "type": "tf32", "emulated": False}
    m = _checked(opts, record, 2 ** -10)                   # a TF32 rounding's size: accepted
    assert m["validation"]["passed"] and m["validation"]["precision"] == "tf32"
    assert "min_cosine" not in m["validation"]             # eager's answers, not the accuracy gate
    assert any("TF32 precision" in n and "--auto-cast-type tf32" in n for n in m["report"]["notes"])
    with pytest.raises(kiln.ValidationError, match=r"tf32\)"):
        _checked(opts, record, 0.05)                       # 5 % of the largest output: wrong
    with tf32.allowed():                           # torch lets convolutions use TF32, as by default
        m = _checked(options.CompileOptions(device="cuda", **tight), None, 2 ** -10)
    assert m["validation"]["precision"] == "tf32"
    assert any("torch's flags" in n and "convolutions (cuDNN" in n for n in m["report"]["notes"])
    cpu = _checked(options.CompileOptions(device="cpu", **tight), None, 0.0)
    assert cpu["validation"]["precision"] == "fp32" and not cpu["report"]["notes"]
    with pytest.raises(kiln.ValidationError):             # the same rounding on a CPU fails
        _checked(options.CompileOptions(device="cpu", **tight), None, 2 ** -10)


def test_a_cache_hit_of_an_emulated_compile_warns_as_the_compile_did(monkeypatch, tmp_path):
    """The warning that emulated bf16/fp16 is slower than fp32 came only with the compile: the
    next process, taking the model from the cache, ran slower without a word."""
    _emulating(monkeypatch)
    model, x = models.mlp()
    with pytest.warns(UserWarning, match="fp16 is emulated"):
        kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type fp16", cache=str(tmp_path))
    with pytest.warns(UserWarning, match="fp16 is emulated"):
        hit = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type fp16", cache=str(tmp_path))
    assert hit.manifest["cache"]["hit"]


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_an_emulated_quantized_build_still_quantizes_its_products(monkeypatch, engine):
    """int4 with emulated bf16: the weights (and their transposes) were rounded on the host,
    where kiln keeps emulated rounding, and reached the engine as inputs rather than
    constants, so nothing was quantized: the build came back in float32, in four partitions,
    with nothing said. Weights are now left for the quantizer; activations are still rounded."""
    _emulating(monkeypatch)
    from tests.test_quantized_openvino import WEIGHT_ONLY, Wide, X
    model = Wide().eval()
    with pytest.warns(UserWarning, match="bf16 is emulated"):
        c = kiln.trace(model, X, quantize="int4", engine=engine, optlevel=1,
                       compiler_args=["--auto-cast", "all", "--auto-cast-type", "bf16"], **WEIGHT_ONLY)
    # no weight enters a partition from the host: each product's weight is a constant in it,
    # and every partition input is an activation (8 rows)
    assert not [s for s in c.manifest["program"]["steps"] if "const" in s]
    partitions = c.manifest["partitions"]
    assert len(partitions) == 3 and all(i["shape"][0] == 8 for p in partitions for i in p["inputs"]), partitions
    if engine == "onnxruntime":
        from kiln.engines.onnxruntime import graph_of
        ops = [n.op_type for p in partitions for n in graph_of(c._artifact.blobs[p["blob"]]).graph.node]
        assert ops.count("MatMulNBits") == 2, ops
    want = model(X).detach()
    assert torch.nn.functional.cosine_similarity(c(X).flatten(), want.flatten(), dim=0) > 0.99
    assert c.manifest["precision"]["emulated"]
