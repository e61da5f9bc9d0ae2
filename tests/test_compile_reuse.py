"""kiln.compiler.reuse_captures: inside the block, builds of one model in several precisions
capture each graph once; what they compile equals separate builds; a model changed in
between is captured afresh and answers with its new weights; outside the block nothing is
reused (and nothing kept)."""
import pytest
import torch

pytest.importorskip("transformers")

from kiln.compiler import reuse, reuse_captures  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402

# two graphs: prefill at width 4 and decode for 2 rows
BUILD = dict(batch_size=2, context_buckets=(4,), cache_length=16, decode_batches=(2,), optlevel=1, cache=False)
PROMPTS = [[1, 5, 9, 2], [7, 3]]


def _tokens(llm):
    return llm.generate(PROMPTS, 8, stop_at_eos=False)


def test_precisions_share_captures_and_equal_separate_builds():
    model = _model("llama")
    with reuse_captures():
        fp32 = compile_llm(model, **BUILD)
        int8 = compile_llm(model, quantize="int8", **BUILD)
        again = compile_llm(model, **BUILD)
        assert reuse.stats() == {"captured": 2, "reused": 4}
    assert reuse.stats() == {"captured": 0, "reused": 0}          # nothing kept after the block
    assert _tokens(int8) == _tokens(compile_llm(model, quantize="int8", **BUILD))
    assert _tokens(again) == _tokens(fp32)


def test_a_model_changed_in_between_is_captured_afresh():
    model = _model("llama")
    with reuse_captures():
        before = _tokens(compile_llm(model, **BUILD))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.down_proj.weight.mul_(-1.0)
        after = compile_llm(model, **BUILD)
        assert reuse.stats() == {"captured": 4, "reused": 0}
    assert _tokens(after) != before                                  # the change shows in the answers
    assert _tokens(after) == [_hf_greedy(model, p, 8) for p in PROMPTS]     # Hugging Face's, changed model


@pytest.mark.parametrize("write", ["no_grad", "data"])
def test_a_weight_changed_in_place_after_capture_is_not_served(write, tmp_path):
    """The kept capture and export share the model's weight tensors: a weight changed in
    place between two compiles, under no_grad (which moves its ``_version``) or through
    ``.data`` (which moves nothing but the values), is captured, exported and compiled
    afresh; the compile cache, keyed by the same fingerprint, serves nothing stale either."""
    import kiln
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    for cache in (False, str(tmp_path / "cache")):
        with reuse_captures():
            first = kiln.trace(model, (x,), optlevel=1, cache=cache)
            if write == "data":
                model[0].weight.data.add_(1.0)
            else:
                with torch.no_grad():
                    model[0].weight.add_(1.0)
            second = kiln.trace(model, (x,), optlevel=1, cache=cache)
            assert reuse.stats()["reused"] == 0
        torch.testing.assert_close(second(x), model(x), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(first(x), second(x))
