"""The validation gate's tolerances (kiln.graph.validation)."""
import copy

import pytest
import torch

import kiln

from kiln.errors import ValidationError
from kiln.graph.validation import compare, narrowest_float


def _next_up(x):
    """Each value about one bf16 ulp up."""
    return (x.float() * (1 + 2 ** -7)).bfloat16()


def test_a_bf16_output_an_ulp_off_passes_a_tight_rtol():
    e = torch.linspace(1, 8, 64).bfloat16()
    a = _next_up(e)
    assert (a != e).sum() > 32                       # really rounded differently
    summary = compare([e], [a], ["y"], atol=1e-3, rtol=1e-3)
    assert summary["passed"] and summary["outputs"][0]["rtol"] == pytest.approx(2 ** -6)


def test_a_bf16_output_that_is_wrong_still_fails_and_says_which_rtol():
    e = torch.linspace(1, 8, 64).bfloat16()
    with pytest.raises(ValidationError, match=r"output .y. \(rtol 0\.015625, atol 0\.125: bfloat16\)"):
        compare([e], [(e.float() * 1.05).bfloat16()], ["y"], atol=1e-3, rtol=1e-3)


def test_fp32_outputs_keep_the_rtol_asked_for():
    e = torch.linspace(1, 8, 64)
    with pytest.raises(ValidationError):
        compare([e], [e * (1 + 2 ** -7)], ["y"], atol=1e-3, rtol=1e-3)


def test_fp32_outputs_of_a_graph_computing_in_bf16_get_its_rtol():
    """Batch norm's fp32 statistics of a bf16 convolution's output carry its rounding."""
    e = torch.linspace(1, 8, 64)
    a = e * (1 + 2 ** -8)
    with pytest.raises(ValidationError):
        compare([e], [a], ["y"], atol=1e-3, rtol=1e-3)
    assert compare([e], [a], ["y"], atol=1e-3, rtol=1e-3, computed_in=torch.bfloat16)["passed"]


def test_the_narrowest_float_of_a_graph_is_found_in_its_values():
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: (x.bfloat16() * 2).float().sum())(torch.randn(4))
    assert narrowest_float(gm) == torch.bfloat16
    assert narrowest_float(make_fx(lambda x: x * 2)(torch.randn(4))) is None


def test_a_split_graphs_narrowest_float_is_found_inside_its_partitions():
    # the compiler checks a graph after splitting it into partitions: the top graph then holds
    # only calls to them (fp32 in and out), and the bf16 values are inside
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.split_module import split_module
    gm = make_fx(lambda x: (x.bfloat16() @ x.bfloat16().t()).float().relu() + 1)(torch.randn(4, 4))
    split = split_module(gm, None, lambda node: 0 if node.target is not torch.ops.aten.add.Tensor else 1)
    top = {n.meta["val"].dtype for n in split.graph.nodes
           if isinstance(n.meta.get("val"), torch.Tensor)}
    assert top == {torch.float32}                       # nothing narrow left at the top
    assert narrowest_float(split) == torch.bfloat16
    assert comparison_precision(split, "cpu") == "bf16"


def test_a_float_output_of_another_dtype_fails_however_close():
    e = torch.linspace(1, 8, 8)
    with pytest.raises(ValidationError, match=r"output 'y': dtype bfloat16, eager gives float32"):
        compare([e], [e.bfloat16()], ["y"], atol=1, rtol=1)


def test_a_bf16_sum_near_zero_is_held_to_the_outputs_scale():
    """Elements that cancel to near zero carry the rounding of their terms' size."""
    e = torch.tensor([64.0, 0.01, -32.0]).bfloat16()
    a = torch.tensor([64.0, 0.26, -32.0]).bfloat16()       # off by half an ulp of 64
    assert compare([e], [a], ["y"], atol=1e-3, rtol=1e-3)["passed"]
    with pytest.raises(ValidationError):                    # three ulps of 64: wrong
        compare([e], [torch.tensor([64.0, 1.5, -32.0]).bfloat16()], ["y"], atol=1e-3, rtol=1e-3)


# -- TF32: graphs on NVIDIA GPUs held to the precision PyTorch lets them compute at ------------

from kiln.compiler import checks, selection               # noqa: E402
from kiln.compiler.driver import make_options              # noqa: E402
from kiln.graph.validation import TF32_RTOL, comparison_precision   # noqa: E402
from kiln.host import tf32                                 # noqa: E402

ALL, NONE = {"conv": True, "matmul": True}, {"conv": False, "matmul": False}


def _graph(fn, *inputs):
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn)(*inputs)


def _conv_graph():
    w = torch.randn(4, 3, 3, 3)
    return _graph(lambda x: torch.nn.functional.conv2d(x, w).relu(), torch.randn(1, 3, 8, 8))


def _matmul_graph():
    w, b = torch.randn(8, 16), torch.randn(8)
    return _graph(lambda x: torch.nn.functional.linear(x, w, b), torch.randn(2, 16))


@pytest.fixture
def torch_tf32_flags():
    """Leaves torch's TF32 flags as they were (the tests set them through torch's legacy
    setters, which keep its legacy and new representations in step)."""
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


def test_a_cuda_graph_with_convolutions_compares_at_tf32_when_cudnn_allows_it():
    gm = _conv_graph()
    assert comparison_precision(gm, "cuda", {"conv": True, "matmul": False}) == "tf32"
    assert comparison_precision(gm, "cuda", {"conv": False, "matmul": True}) == "fp32"
    assert comparison_precision(gm, "cuda", NONE) == "fp32"


def test_a_cuda_graph_with_matmuls_compares_at_tf32_only_when_matmuls_may_use_it():
    gm = _matmul_graph()
    assert comparison_precision(gm, "cuda", {"conv": True, "matmul": False}) == "fp32"
    assert comparison_precision(gm, "cuda", {"conv": False, "matmul": True}) == "tf32"
    assert comparison_precision(_graph(lambda x: x.exp() * 2, torch.randn(4)), "cuda", ALL) == "fp32"


def test_a_cpu_graph_never_compares_at_tf32():
    for gm in (_conv_graph(), _matmul_graph()):
        assert comparison_precision(gm, "cpu", ALL) == "fp32"
        assert comparison_precision(gm, "cpu") == "fp32"
    bf16 = _graph(lambda x: (x.bfloat16() * 2).float(), torch.randn(4))
    assert comparison_precision(bf16, "cpu") == "bf16" and comparison_precision(bf16, "cuda", ALL) == "bf16"


def test_torchs_flags_decide_tf32_where_the_gpu_has_it(monkeypatch, torch_tf32_flags):
    """Default flags: cuDNN convolutions in TF32, cuBLAS matmuls not; read from torch."""
    monkeypatch.setattr(tf32, "computed_here", lambda: True)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    assert tf32.flags() == {"conv": True, "matmul": False}
    assert comparison_precision(_conv_graph(), "cuda") == "tf32"
    assert comparison_precision(_matmul_graph(), "cuda") == "fp32"
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("high")
    assert tf32.flags() == {"conv": False, "matmul": True}
    assert comparison_precision(_conv_graph(), "cuda") == "fp32"
    assert comparison_precision(_matmul_graph(), "cuda") == "tf32"
    monkeypatch.setattr(tf32, "computed_here", lambda: False)     # before Ampere: fp32 is fp32
    assert comparison_precision(_matmul_graph(), "cuda") == "fp32"


@pytest.mark.skipif(not hasattr(torch.backends.cudnn, "conv"), reason="torch before 2.9: no fp32_precision")
def test_torchs_new_fp32_precision_api_is_read(torch_tf32_flags):
    conv, matmul = torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert tf32.flags() == {"conv": False, "matmul": True}
    finally:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = conv, matmul


def test_allowing_tf32_for_a_compile_restores_torchs_flags(torch_tf32_flags):
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    with tf32.allowed():
        assert tf32.flags() == ALL
    assert tf32.flags() == NONE and torch.get_float32_matmul_precision() == "highest"


def _logits(seed=0):
    """Outputs up to 254 in magnitude, like ResNet-50's on an H100."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(1000, generator=g)
    return e / e.abs().max() * 254


def test_tf32_accepts_the_rounding_of_a_correct_gpu_build_and_fp32_does_not():
    """0.3 off on outputs up to 254: what eager's own TF32 and IEEE answers differ by."""
    e = _logits()
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    a = e + 0.3 * noise / noise.abs().max()
    summary = compare([e], [a], ["logits"], atol=1e-3, rtol=1e-3, computed_in="tf32")
    assert summary["passed"] and summary["precision"] == "tf32"
    out = summary["outputs"][0]
    assert out["precision"] == "tf32" and out["rtol"] == TF32_RTOL == 2 ** -8
    assert out["atol"] == pytest.approx(254 * 2 ** -8)
    with pytest.raises(ValidationError, match=r"output 'logits': max abs error 0\.3"):
        compare([e], [a], ["logits"], atol=1e-3, rtol=1e-3)
    with pytest.raises(ValidationError):
        compare([e], [a], ["logits"], atol=1e-3, rtol=1e-3, computed_in="fp32")


def test_tf32_still_rejects_a_real_error():
    e = _logits()
    with pytest.raises(ValidationError, match=r"output 'logits' \(rtol 0\.00390625, atol 0\.992: tf32\)"):
        compare([e], [e * 1.02], ["logits"], atol=1e-3, rtol=1e-3, computed_in="tf32")
    wrong = e.clone()
    wrong[0] += 5.0                                   # one logit 2 % of the largest off
    with pytest.raises(ValidationError):
        compare([e], [wrong], ["logits"], atol=1e-3, rtol=1e-3, computed_in="tf32")


def test_an_fp32_comparison_is_todays_and_says_so():
    e = torch.linspace(1, 8, 64)
    a = e * (1 + 2e-4)
    assert compare([e], [a], ["y"], atol=1e-3, rtol=1e-3) == \
        compare([e], [a], ["y"], atol=1e-3, rtol=1e-3, computed_in="fp32")
    summary = compare([e], [a], ["y"], atol=1e-3, rtol=1e-3)
    assert summary["precision"] == "fp32" and "rtol" not in summary["outputs"][0]
    assert compare([e.bfloat16()], [e.bfloat16()], ["y"], atol=1e-3, rtol=1e-3)["precision"] == "bf16"


def test_engine_selection_holds_gpu_builds_to_tf32_and_cpu_builds_to_atol_rtol(monkeypatch, torch_tf32_flags):
    """The per-partition check (kiln.compiler.selection) uses the same rule: a TF32 build on a
    GPU is not recorded as inaccurate; on the CPU nothing changes."""
    e = _logits()
    a = e + 0.3
    cpu = make_options(device="cpu")
    assert "differs from eager" in checks.disagreement([e], [a], cpu, None)
    assert checks.disagreement([e], [a], cpu, "tf32") is None
    assert "differs from eager" in checks.disagreement([e], [e * 1.02], cpu, "tf32")
    monkeypatch.setattr(selection, "cuda_available", lambda: True)
    gpu = make_options(device="cuda")
    assert selection._Reference(_conv_graph(), [], cpu).precision is None
    monkeypatch.setattr(tf32, "computed_here", lambda: True)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True                    # torch's defaults
    assert selection._Reference(_conv_graph(), [], gpu).precision == "tf32"
    assert selection._Reference(_matmul_graph(), [], gpu).precision is None      # fp32: held as asked
    tf32_gpu = make_options("--auto-cast matmult --auto-cast-type tf32", device="cuda")
    assert selection._Reference(_matmul_graph(), [], tf32_gpu).precision == "tf32"
    assert selection._Reference(_conv_graph(), [], tf32_gpu).precision == "tf32"


def test_engine_selection_holds_a_bf16_graphs_builds_to_bf16s_floor_on_the_cpu():
    """A CPU graph with bf16 values (an autocast training step) is checked per partition at
    bf16's floor, as the model's validation gate checks it: its fp32 outputs (gradients of
    bf16 products) carry bf16's roundings. The device's bf16 MLP step whole on Inductor
    differed from eager by 1.2e-3 in one gradient, which the gate passes and 1e-3 did not."""
    cpu = make_options(device="cpu")
    w = torch.randn(8, 16)
    bf16 = _graph(lambda x: torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float(), torch.randn(2, 16))
    assert selection._Reference(bf16, [], cpu).precision == "bf16"
    assert selection._Reference(_matmul_graph(), [], cpu).precision is None       # fp32: as asked
    e = torch.linspace(-1, 1, 64)
    assert "differs from eager" in checks.disagreement([e], [e + 1.2e-3], cpu, None)
    assert checks.disagreement([e], [e + 1.2e-3], cpu, "bf16") is None
    assert "differs from eager" in checks.disagreement([e], [e + 0.05], cpu, "bf16")


def test_float16_outputs_are_compared_in_float32_not_crashed():
    """The check clamps outputs to +-1e30 (saturated masks), which is no float16: a float16
    output not within atol of eager's raised "value cannot be converted to type c10::Half
    without overflow", and with it the compile of every float16 model."""
    cpu = make_options(device="cpu")
    e = torch.linspace(-8, 8, 64).half()
    a = (e.float() + 5e-3).half()           # within float16's floor: 2 ulps of the largest, 0.0156
    assert checks.disagreement([e], [a], cpu, "fp16") is None
    assert "differs from eager" in checks.disagreement([e], [a], cpu, None)
    assert "differs from eager" in checks.disagreement([e], [(e.float() + 0.1).half()], cpu, "fp16")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).half().eval()
    x = torch.randn(4, 8, dtype=torch.float16)
    compiled = kiln.trace(model, x, optlevel=1, cache=False)
    assert compiled.manifest["validation"]["precision"] == "fp16"
    torch.testing.assert_close(compiled(x), model(x), rtol=2e-3, atol=2e-3)


def test_padding_and_batch_checks_of_a_tf32_build_use_its_precision():
    """Padded or chunked answers of a build checked at TF32 carry the same rounding."""
    from types import SimpleNamespace
    from kiln.compiler.api import padding_tolerance
    e = _logits()
    gpu = SimpleNamespace(manifest={"validation": {"precision": "tf32"}})
    wrapper = SimpleNamespace(manifest={}, inner_models=lambda: [gpu])      # buckets, dynamic batch
    cpu = SimpleNamespace(manifest={"validation": {"precision": "fp32"}})
    opts = make_options(device="cpu")
    for compiled in (gpu, wrapper):
        tol = padding_tolerance(opts, compiled)
        assert tol.precision == "tf32" and "tf32" in str(tol)
        assert tol.compare([e], [e + 0.3], ["logits"]) == pytest.approx(0.3, rel=1e-4)
        with pytest.raises(ValidationError):
            tol.compare([e], [e * 1.02], ["logits"])
    tol = padding_tolerance(opts, cpu)
    assert tol.precision is None
    with pytest.raises(ValidationError):
        tol.compare([e], [e + 0.3], ["logits"])


# -- a narrow graph judged against itself in float32 (kiln.graph.widened) --------------------

def _bf16_capture():
    from kiln.graph.capture import capture
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    return model, x, capture(copy.deepcopy(model).bfloat16(), (x.bfloat16(),))


def test_a_bf16_graph_widened_computes_the_float32_model(monkeypatch):
    from kiln.graph import widened
    model, x, captured = _bf16_capture()
    wide = widened.widened(captured.graph_module)
    out = wide(x.bfloat16().float())
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.dtype == torch.float32
    # the float32 model with its weights rounded to bf16 once: the same computation
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
        torch.testing.assert_close(out, rounded(x.bfloat16().float()), rtol=1e-5, atol=1e-5)
    assert captured.graph_module(x.bfloat16())[0].dtype == torch.bfloat16      # the capture is untouched
    monkeypatch.setattr(widened, "MAX_WIDENED_BYTES", 16)
    assert widened.widened(captured.graph_module) is None                     # too large: the gate alone


def test_a_build_nearer_the_float32_graph_than_eager_passes_and_a_further_one_does_not():
    """Inductor's bf16 BERT-base was 0.050 from BERT-base in float32 where eager's bf16 was
    0.070, and 0.094 from eager: over the bf16 floor, yet the better answer."""
    from types import SimpleNamespace
    from kiln.compiler import driver
    from kiln.graph import widened
    _, x, captured = _bf16_capture()
    truth = widened.widened(captured.graph_module)(x.bfloat16().float())[0]
    eager = captured.eager_outputs
    closer = [truth.bfloat16()]                                # one rounding from the truth
    verdict = widened.nearer_than_eager(captured.graph_module, captured.example_inputs, eager, closer)
    assert verdict is not None and verdict["reference"] == "float32"
    (o,) = verdict["outputs"]
    assert o["build_error"] <= o["eager_error"]
    further = [(truth + 4 * (eager[0].float() - truth).abs().max()).bfloat16()]
    assert widened.nearer_than_eager(captured.graph_module, captured.example_inputs, eager, further) is None
    # where eager is exact (a float32 path), a build a float32 rounding off still passes
    exact = [truth.clone()]
    assert widened.nearer_than_eager(captured.graph_module, captured.example_inputs, exact,
                                     [truth * (1 + 2 ** -23)]) is not None
    assert widened.nearer_than_eager(captured.graph_module, captured.example_inputs, exact, [truth * 1.01]) is None
    nan = [closer[0].clone().fill_(float("nan"))]
    assert widened.nearer_than_eager(captured.graph_module, captured.example_inputs, eager, nan) is None
    # only for the narrow whole-graph plan, and never over a dtype or integer difference
    narrow, other = SimpleNamespace(narrow_whole=True), SimpleNamespace(narrow_whole=False)
    floats = {"outputs": [{"name": "y", "max_abs_error": 0.1}]}
    assert driver._nearer_than_eager(narrow, captured, closer, floats) is not None
    assert driver._nearer_than_eager(other, captured, closer, floats) is None
    assert driver._nearer_than_eager(narrow, None, closer, floats) is None
    assert driver._nearer_than_eager(narrow, captured, closer, {"outputs": [{"name": "i", "exact": False}]}) is None
    assert driver._nearer_than_eager(narrow, captured, closer, {"outputs": [{"name": "y", "dtype": "x"}]}) is None


def test_probe_comparisons_take_the_plain_path_under_a_precision_floor_and_never_subtract_in_bf16():
    """A bf16 graph's probe outputs within atol of eager's pass without the full test (the
    floor only loosens it), and a bf16 difference is taken in float32, where it cannot round
    down to atol: 2**-10 - (-2**-18) is 2**-10 in bf16 and over atol in fact."""
    from kiln.compiler.options import CompileOptions
    opts = CompileOptions(atol=2 ** -10)
    e = torch.tensor([1.0, -2.0 ** -18], dtype=torch.bfloat16)
    near = e.clone()
    near[0] += 2 ** -7                                  # 1.0078125: a bf16 ulp, over atol
    assert checks._plainly_close(e, e.clone(), opts)
    assert not checks._plainly_close(e, near, opts)
    assert not checks.nonfinite_disagreement([e], [e.clone()], opts, "bf16")
    rounded = torch.tensor([2.0 ** -10], dtype=torch.bfloat16)
    e2 = torch.tensor([-2.0 ** -18], dtype=torch.bfloat16)
    assert float((rounded - e2).abs().max()) <= opts.atol          # bf16 arithmetic would pass it
    assert not checks._plainly_close(e2, rounded, opts)             # float32 does not
    assert checks.disagreement([e2], [rounded], opts, "bf16") is not None
    with_nan = e.clone()
    with_nan[1] = float("nan")
    assert not checks._plainly_close(e, with_nan, opts)


def test_a_broadcast_example_input_is_probed_in_a_layout_of_its_own():
    """An example whose elements share memory (stride 0: a sum's gradient on kiln's device
    is ones expanded) gets the NaN/infinity probes in a contiguous copy. Writing them into a
    tensor laid out like it failed ("more than one element of the written-to tensor refers
    to a single memory location"), and a small SGD step's device program ran uncompiled."""
    class Step(torch.nn.Module):
        def forward(self, grad, h):
            return torch.tanh(h) * grad, (1 - torch.tanh(h) ** 2) * grad

    grad = torch.ones(()).expand(4, 8)
    assert grad.stride() == (0, 0)
    h = torch.randn(4, 8)
    m = kiln.trace(Step(), (grad, h), quiet=True, cache=False)
    for got, want in zip(m(grad, h), Step()(grad, h)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m.manifest["partitions"], m.manifest


def test_values_eager_refuses_are_probed_without_ending_the_compile():
    """The NaN/infinity probe runs eager on the probe's values too; where eager raises on
    them (``linalg.eigvalsh`` of a NaN matrix does not converge), a build that raises as well
    agrees and one that answers is listed as differing. Eager's error ended the compile: the
    device ran a graph holding ``linalg.eigh`` eagerly, with a warning naming the error."""
    from kiln.compiler import checks
    from kiln.compiler.options import CompileOptions

    class Eigen(torch.nn.Module):
        def forward(self, a):
            return torch.linalg.eigvalsh(a @ a.mT + 4 * torch.eye(4, dtype=a.dtype))

    a = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        Eigen()(torch.full((4, 4), float("nan"), dtype=torch.float64))
    reference = checks.Reference(torch.fx.symbolic_trace(Eigen()), [a], CompileOptions())

    def raising(inputs):
        return [Eigen()(*inputs)]
    assert checks.nonfinite_probe(raising, reference, CompileOptions()) == []

    def answering(inputs):
        x = inputs[0]
        return [Eigen()(torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0))]
    assert checks.nonfinite_probe(answering, reference, CompileOptions()) == ["nan", "+inf", "-inf"]
