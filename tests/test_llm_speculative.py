"""Speculative decoding (kiln.runtime.speculative): whatever the draft proposes, the
output is the target's greedy output; the acceptance rate says how often it agreed."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from kiln.runtime.speculative import SpeculativeDecoder  # noqa: E402
from tests.test_llm_decoder import COMMON, PROMPTS, _hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def models(tiny_llm):
    """(HF target, the target compiled with a verify graph, an unrelated draft: the
    session's tiny Llama, another random model with the same vocabulary)."""
    torch.manual_seed(1)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})).eval()
    for p in target.parameters():
        torch.nn.init.normal_(p, std=0.3)
    target.generation_config.eos_token_id = None
    compiled = compile_llm(target, speculation_length=4, batch_size=1, context_buckets=(8,), cache_length=40,
                           optlevel=1)
    return target, compiled, tiny_llm[1]


def test_output_is_the_targets_greedy_output_with_any_draft(models):
    hf_target, target, unrelated = models
    for prompt in PROMPTS:
        want = _hf_greedy(hf_target, prompt, 20)
        same, stats = SpeculativeDecoder(target, target).generate(prompt, 20)     # the target as its own draft
        assert same == want and stats.acceptance_rate == 1.0
        assert stats.rounds <= 5                                                  # 5 tokens per round
        got, stats = SpeculativeDecoder(target, unrelated).generate(prompt, 20)
        assert got == want, prompt
        assert stats.acceptance_rate < 0.5 and stats.rounds > 5
    stop = want[7]
    got, _ = SpeculativeDecoder(target, unrelated).generate(PROMPTS[-1], 20, stop_token_ids=[stop])
    assert got == want[:want.index(stop) + 1]


def test_clear_errors(models):
    hf_target, target, unrelated = models
    with pytest.raises(InputError, match="no verify graph"):
        SpeculativeDecoder(unrelated, target)
    with pytest.raises(InputError, match="must fit the caches"):
        SpeculativeDecoder(target, unrelated).generate([1, 2], 36)
    with pytest.raises(CompilerArgsError, match="speculation_length"):
        compile_llm(hf_target, context_buckets=(8,), cache_length=16, speculation_length=16)
