"""The validation gate's tolerances (kiln.graph.validation)."""
import pytest
import torch

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
