"""Chunked prefill (compile_llm(prefill_chunk=c)): prompts longer than the largest context
bucket run, a chunk per step between other requests' decode steps, and every request
gets Hugging Face's greedy tokens, alone or batched, before and after a save and load."""
import pytest

pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from kiln.runtime.scheduler import Request  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402

# one shorter than the bucket, one exactly a bucket, one over two chunk boundaries, one
# ending a token past a chunk boundary (the last chunk mostly padding)
PROMPTS = [[5, 17, 3], [11, 2, 60, 61], [60, 61, 62, 63, 64, 7, 9, 9, 9, 30, 31], [4, 3, 2, 1, 8, 8, 8, 8, 1]]


@pytest.fixture(scope="module")
def chunked():
    model = _model("llama")
    llm = compile_llm(model, batch_size=2, context_buckets=(4,), cache_length=32, prefill_chunk=4, optlevel=1,
                      decode_batches=(2,))
    return model, llm


def test_long_prompts_run_in_chunks_and_match_hugging_face(chunked, tmp_path):
    model, llm = chunked
    expected = [_hf_greedy(model, p, 8) for p in PROMPTS]
    assert llm.generate(PROMPTS, 8, stop_at_eos=False) == expected          # 4 requests, 2 slots
    assert [llm.generate([p], 8, stop_at_eos=False)[0] for p in PROMPTS] == expected
    path = tmp_path / "chunked.kiln"
    llm.save(path)
    loaded = kiln.load(path)
    assert loaded.manifest["graphs"]["chunk"] == "chunk/4.kiln" and loaded.meta["prefill_chunk"] == 4
    assert loaded.generate(PROMPTS[2:], 8, stop_at_eos=False) == expected[2:]


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_another_decodes(chunked):
    model, llm = chunked
    sched = llm.scheduler()
    short = sched.add(Request([5, 17, 3], 10))
    sched.step()
    assert len(short.tokens) == 2                 # prefill's token, then a decode step's
    long = sched.add(Request(PROMPTS[2], 6))       # 11 tokens: 4 through prefill, then 4 and 3
    sched.step()
    assert (long.prefilled, sched.prefill_chunks, len(long.tokens), len(short.tokens)) == (8, 1, 0, 3)
    sched.step()
    assert (long.prefilled, sched.prefill_chunks, len(long.tokens), len(short.tokens)) == (11, 2, 2, 4)
    sched.run()
    assert short.tokens == _hf_greedy(model, [5, 17, 3], 10)
    assert long.tokens == _hf_greedy(model, PROMPTS[2], 6)


def test_the_cache_still_bounds_a_chunked_prompt(chunked):
    _, llm = chunked
    with pytest.raises(InputError, match="exceed the compiled cache of 32"):
        llm.generate([list(range(1, 30))], 4)
    with pytest.raises(CompilerArgsError, match="prefill_chunk must be in"):
        compile_llm(_model("llama"), context_buckets=(4,), cache_length=32, prefill_chunk=32)


SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15]          # a shared "system prompt": two chunks and a token


def test_a_shared_prompt_prefix_is_reused_not_prefilled_again(chunked):
    model, llm = chunked
    sched = llm.scheduler()
    first = sched.add(Request(SHARED + [40, 41], 5))
    sched.run()                                      # finished: its row still holds the prefix
    later = sched.add(Request(SHARED + [50, 51, 52], 5))
    sched.step()
    assert sched.reused_positions == len(SHARED)     # the whole shared prefix; the rest by chunks
    running = sched.add(Request(SHARED + [60], 5))   # reuses the running request's row
    sched.run()
    assert sched.reused_positions == 2 * len(SHARED)
    for r in (first, later, running):
        assert r.tokens == _hf_greedy(model, r.prompt, 5), r.prompt
    off = llm.scheduler(prefix_reuse=False)
    again = off.add(Request(SHARED + [50, 51, 52], 5))
    off.run()
    assert off.reused_positions == 0 and again.tokens == later.tokens
