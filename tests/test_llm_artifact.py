"""An LLM compiled into one .kiln artifact (prefill per context bucket + decode), saved,
loaded in a fresh process without the model's code, and generating Hugging Face's tokens."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from tests.conftest import run_py  # noqa: E402
from tests.test_llm_decoder import PROMPTS, _hf_greedy, _model  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tiny_llm):
    return tiny_llm


def test_artifact_generates_hugging_face_tokens_in_a_fresh_process(compiled, tmp_path):
    model, llm, path = compiled
    expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    assert llm.meta["eos_token_ids"] == []       # the test model's eos is off (see _model)
    code = f"""
import json, sys, kiln
m = kiln.load({str(path)!r})
print(repr(m))
print(json.dumps(m.generate({PROMPTS!r}, 12)))
print(json.dumps(m.generate([[3, 1, 4]], 5)))
assert not any(k.startswith(('transformers', 'tests')) for k in sys.modules), 'model code imported'
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "context buckets [4, 8]" in lines[0]
    assert json.loads(lines[1]) == expected
    assert json.loads(lines[2]) == [_hf_greedy(model, [3, 1, 4], 5)]      # fewer rows than the batch


def test_bad_requests_are_clear_errors(compiled):
    _, llm, _ = compiled
    with pytest.raises(InputError, match="longer than the largest context bucket \\(8\\)"):
        llm.generate([list(range(1, 10))], 2)
    with pytest.raises(InputError, match="max_new_tokens must be at least 1"):
        llm.generate([[1]], 0)
    with pytest.raises(InputError, match="exceed the compiled cache of 32"):
        llm.generate([[1, 2]], 31)
    with pytest.raises(InputError, match="at least one token"):
        llm.generate([[]], 2)


def test_bad_compile_options_are_clear_errors():
    model = _model("llama")
    with pytest.raises(CompilerArgsError, match="exceeds cache_length"):
        compile_llm(model, context_buckets=(64,), cache_length=32)
    with pytest.raises(kiln.errors.UnsupportedModelError):
        compile_llm(torch.nn.Linear(2, 2))
    with pytest.raises(CompilerArgsError, match="exceeds the 128 positions GPT2LMHeadModel has learned"):
        compile_llm(_model("gpt2"), context_buckets=(8,), cache_length=256)


def test_hugging_face_generate_signature_with_left_padding_and_eos(compiled):
    """``hf_generate(input_ids, attention_mask, generation_config)`` returns what
    transformers' ``generate`` returns for a left-padded batch, rows ending at EOS padded."""
    model, llm, _ = compiled
    ids = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8], [0, 0, 0, 60, 61]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    config = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, generation_config=config)
    got = llm.hf_generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(got, want)
    assert (want[:, 5:] == 2).any()                     # a row did stop at EOS
    assert llm.hf_generate(ids[:1, 2:], max_new_tokens=3).shape == (1, 6)
    with pytest.raises(InputError, match="settings kiln does not know"):
        llm.hf_generate(ids, attention_mask=mask, beam_width=4)


def test_hugging_face_lengths_and_settings_kiln_does_not_do(compiled):
    """``max_length`` (the prompt's padded width plus the new tokens; 20 new tokens when no
    length is set) as transformers counts it, from an override or the config, and ``max_new_tokens``
    over it; settings that would change the tokens and that kiln does not implement are
    errors naming them. Before: ``max_length`` was an unknown setting, a config's was
    ignored (20 new tokens whatever it said), and a config's ``num_beams=4`` decoded
    greedily without a word."""
    model, llm, _ = compiled
    ids = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    base = dict(do_sample=False, eos_token_id=2, pad_token_id=0)
    cases = [(transformers.GenerationConfig(**base), {}),                              # 20 new tokens
             (transformers.GenerationConfig(max_length=9, **base), {}),
             (transformers.GenerationConfig(**base), {"max_length": 12}),
             (transformers.GenerationConfig(max_length=30, **base), {"max_new_tokens": 4})]
    for config, kwargs in cases:
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        got = llm.hf_generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        assert torch.equal(got, want), (config.max_length, kwargs)
    assert llm.hf_generate(ids, attention_mask=mask, max_length=8).shape == (2, 8)
    with pytest.raises(InputError, match="num_beams=4"):
        llm.hf_generate(ids, attention_mask=mask, generation_config=transformers.GenerationConfig(num_beams=4))
    with pytest.raises(InputError, match="no_repeat_ngram_size=3"):
        llm.hf_generate(ids, attention_mask=mask, no_repeat_ngram_size=3)
    with pytest.raises(InputError, match="max_length is 5"):
        llm.hf_generate(ids, attention_mask=mask, max_length=5)
    # a refused setting at its default is harmless, and None is a setting's default, as there
    assert llm.hf_generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=2).shape == (2, 7)
    assert llm.hf_generate(ids, attention_mask=mask, temperature=None, max_new_tokens=2).shape == (2, 7)


def test_generate_calls_reuse_one_zeroed_kv_cache(compiled):
    """Each ``generate`` call's cache takes the LLM's kept buffers (kiln.runtime.kv.CacheMemory)
    instead of allocating them, zeroed first: stale values from an earlier call, even NaN,
    never reach a later one, whose tokens stay Hugging Face's."""
    import copy

    from kiln.runtime import kv
    model, shared, _ = compiled
    # the session's LLM with memory of its own: a scheduler another test left alive would hold
    # the shared one's buffers
    llm = copy.copy(shared)
    llm.cache_memory = kv.CacheMemory("cpu")
    expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    keys, values = llm.cache_memory._buffers
    address = keys.data_ptr()
    keys.fill_(float("nan"))            # what a call that overflowed might leave behind
    values.fill_(float("nan"))
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    assert llm.cache_memory._buffers[0].data_ptr() == address          # the same memory, not a new one
    held = llm.scheduler()              # a live cache: the next call gets buffers of its own
    assert held.cache.keys.data_ptr() == address and not held.cache.keys.isnan().any()
    assert llm.generate(PROMPTS[:1], 12, stop_at_eos=False) == expected[:1]
    del held
