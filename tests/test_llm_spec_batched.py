"""Speculative decoding in the continuous-batching scheduler and the server
(kiln.runtime.spec_step, kiln.runtime.drafters): each row of one verify call sits at its
own cache position and keeps its own number of proposals, and every request gets the
tokens the target gives it alone: greedy, seeded sampling, logprobs, stop tokens."""
import concurrent.futures
import copy
import logging
import re

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.errors import InputError  # noqa: E402
from kiln.llm.build import add_verify  # noqa: E402
from kiln.llm.decoder import DecoderStep  # noqa: E402
from kiln.runtime.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from kiln.runtime.llm import LLM  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402
from kiln.runtime.scheduler import Request, Scheduler  # noqa: E402
from kiln.runtime.spec_step import SpeculativeStep  # noqa: E402
from kiln.runtime.text import Tokenizer  # noqa: E402
from tests.test_llm_decoder import _hf_greedy  # noqa: E402
from tests.test_serve import Server  # noqa: E402

K = 3
GREEDY = SamplingParams()
WARM = SamplingParams(do_sample=True, temperature=1.3, top_p=0.9, seed=11)
PENALTY = SamplingParams(repetition_penalty=1.4)
# (prompt, max_new_tokens, params, logprobs): lengths, buckets and settings differ per row
CASES = [([5, 17, 3, 88, 42, 7, 9], 12, GREEDY, None), ([11, 2], 20, GREEDY, 2), ([60, 61, 62], 5, WARM, None),
         ([1], 17, PENALTY, None), ([9, 9, 9, 9, 9, 9, 9, 9], 9, GREEDY, None), ([4, 3, 2, 1], 14, WARM, 1),
         ([30, 31], 1, GREEDY, None), ([70, 71, 72, 73, 74, 75], 24, GREEDY, None)]


@pytest.fixture(scope="module")
def target(tiny_llm, tmp_path_factory):
    """(HF model, the session's tiny LLM with verify graphs for 1 and 3 rows of K + 1 tokens,
    its saved path). The verify graphs use the eager engine: compiled in ~2 s, not ~10."""
    model, llm, _ = tiny_llm
    spec = add_verify(model, llm, K, optlevel=1, engine="eager")
    path = tmp_path_factory.mktemp("spec") / "target.kiln"
    spec.save(path)
    return model, spec, path


def _eager_llm(hf, like):
    """An LLM object over eager DecoderSteps of ``hf`` (a draft without compiling one)."""
    prefill = DecoderStep(hf, with_cache=False, last_only=True).eval()
    decode = DecoderStep(hf, with_cache=True, last_only=False).eval()
    return LLM({8: prefill}, {1: decode, 3: decode}, dict(like.meta), {}, manifest={"kind": "llm"})


def _noisy_draft(model, like, std=0.12):
    """The target's weights plus noise: a draft that agrees often, not always."""
    torch.manual_seed(3)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * std)
    return _eager_llm(draft, like)


def _solo(llm, prompt, n, params, logprobs=None, stops=()):
    sched = llm.scheduler()
    r = sched.add(Request(prompt, n, params, stops, logprobs=logprobs))
    sched.run()
    return r


def _run_joining(sched, cases):
    """Five requests at once (three slots: two wait), three more joining mid-flight."""
    requests = [Request(p, n, params, logprobs=lp) for p, n, params, lp in cases]
    for r in requests[:5]:
        sched.add(r)
    for _ in range(3):
        sched.step()
    for r in requests[5:]:
        sched.add(r)
    sched.run()
    return requests


def test_batched_speculation_gives_every_request_its_solo_tokens(target):
    model, llm, _ = target
    solo = [_solo(llm, p, n, params, lp) for p, n, params, lp in CASES]
    for (p, n, params, _), r in zip(CASES, solo):
        if params is GREEDY:
            assert r.tokens == _hf_greedy(model, p, n), p
    sched = llm.scheduler(draft=_noisy_draft(model, llm))
    got = _run_joining(sched, CASES)
    for want, r in zip(solo, got):
        assert r.tokens == want.tokens and r.finish_reason == "length", r.prompt
        assert len(r.token_logprobs) == len(want.token_logprobs)
        for (lp, top), (want_lp, want_top) in zip(r.token_logprobs, want.token_logprobs):
            assert abs(lp - want_lp) < 1e-4 and [i for i, _ in top] == [i for i, _ in want_top]
            assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(top, want_top))
    accepted = [r.draft_accepted for r in got if r.max_new_tokens > 1]
    assert len(set(accepted)) > 2, accepted                      # rows kept different numbers
    assert 0 < sched.draft_accepted < sched.draft_proposed
    assert sched.draft_proposed == sum(r.draft_proposed for r in got)
    assert got[6].draft_proposed == 0                            # max_new_tokens 1: nothing to propose
    assert all(r.draft_proposed <= K * len(r.tokens) for r in got)
    assert sched.speculative.rounds > 0 and sched.moves > 0 and not sched.cache.lengths.any()
    # the one-row verify graph of older artifacts: rows verified one call each, same tokens
    old = Scheduler(llm.prefill_for, llm.decode, llm.meta["cache_shape"], max_context=llm.max_context,
                    speculative=SpeculativeStep({1: llm.verify_steps[1]}, K, ModelDrafter(llm, llm.meta)))
    again = _run_joining(old, CASES[:5])
    assert [r.tokens for r in again] == [r.tokens for r in solo[:5]]
    greedy = [r for r, case in zip(again, CASES) if case[2] is GREEDY and r.max_new_tokens > 1]
    assert all(r.draft_accepted == r.draft_proposed > 0 for r in greedy)    # the target as its own draft


def test_stops_inside_an_accepted_run_and_ngram_drafting(target):
    model, llm, _ = target
    full = _solo(llm, [11, 2], 20, GREEDY).tokens
    stop = full[6]
    sched = llm.scheduler(draft=llm)                             # accepts every proposal
    at = sched.add(Request([11, 2], 20, stop_token_ids=[stop]))
    listener = sched.add(Request([11, 2], 20, on_token=lambda r, t: len(r.tokens) == 5))
    # a request whose stop token is a kept proposal (positions 1..K of the first round; the
    # prefill gave position 0): the accepted count as each token is heard, as the server
    # reports usage from there, already includes it
    proposal_stop = next(t for j, t in enumerate(full[1:K + 1], start=1) if t not in full[:j])
    seen = []
    counted = sched.add(Request([11, 2], 20, stop_token_ids=[proposal_stop],
                                on_token=lambda r, t: seen.append(r.draft_accepted)))
    sched.run()
    assert counted.tokens[-1] == proposal_stop and seen[-1] == counted.draft_accepted > 0
    assert at.tokens == full[:full.index(stop) + 1] and at.finish_reason == "stop"
    assert listener.tokens == full[:5] and listener.finish_reason == "stop"
    assert at.draft_accepted == at.draft_proposed > 0      # a stop token among the kept proposals counts
    # prompt lookup: a prompt quoting itself, and outputs that repeat
    prompts = [[40, 41, 42, 43, 40, 41, 42, 43], [7, 8, 9, 7, 8], [3, 3, 3]]
    want = [_hf_greedy(model, p, 20) for p in prompts]
    sched = llm.scheduler(draft="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    requests = [sched.add(Request(p, 20)) for p in prompts]
    sched.run()
    assert [r.tokens for r in requests] == want
    assert sched.draft_accepted > 0
    assert llm.generate(prompts, 20, draft="ngram", stop_at_eos=False) == want


def test_ngram_lookup_and_clear_errors(tiny_llm, target, caplog):
    d = NgramDrafter(prompt_lookup_max=3, prompt_lookup_min=1)
    assert d.lookup([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]           # the longest suffix first
    assert d.lookup([1, 2, 5, 1, 2, 6, 1, 2], 2) == [6, 1]           # its latest earlier occurrence
    assert d.lookup([1, 2, 3], 2) == []
    with pytest.raises(InputError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramDrafter(2, 3)
    model, plain, _ = tiny_llm
    with pytest.raises(InputError, match="compile it with speculation_length=k .*--speculation-length"):
        plain.scheduler(draft="ngram")
    _, llm, _ = target
    other = _eager_llm(model, llm)
    other.meta["vocab_size"] = 50
    with pytest.raises(InputError, match=r"draft's vocabulary \(50 ids\) is not the target's \(97\)"):
        llm.scheduler(draft=other)
    other.meta.update(vocab_size=97, cache_shape=[2, 1, 2, 32, 8])
    with pytest.raises(InputError, match="compile the draft with --batch-size 3"):
        llm.scheduler(draft=other)
    with pytest.raises(InputError, match="draft= takes 'ngram'"):
        llm.scheduler(draft=3.5)
    # a context longer than the draft's largest bucket decodes without proposals: the same
    # answer, and now a warning (the speed-up was lost without a word; found by probing)
    short = _eager_llm(model, llm)
    short.prefill = {4: short.prefill[8]}
    assert short.max_context == 4
    prompt = [5, 17, 33, 40, 2, 9]
    alone = _solo(llm, prompt, 6, SamplingParams()).tokens
    with caplog.at_level(logging.WARNING, logger="kiln"):
        sched = llm.scheduler(draft=short)
        r = sched.add(Request(prompt, 6, SamplingParams()))
        sched.run()
    assert r.tokens == alone and r.draft_proposed == 0
    assert "longer than the draft's largest context bucket (4)" in caplog.text
    from kiln.errors import KilnError
    from kiln.serving.server import parse_drafts
    assert parse_drafts(["ngram"], ["a=x.kiln"]) == {"*": "ngram"}
    assert parse_drafts(["a=d.kiln"], ["a=x.kiln"]) == {"a": "d.kiln"}
    with pytest.raises(KilnError, match="--draft names b, which is not a served model"):
        parse_drafts(["b=ngram"], ["a=x.kiln"])


def test_server_streams_speculative_answers_equal_to_the_target_alone(tiny_llm, target, tmp_path):
    _, llm, path = target
    _, _, draft_path = tiny_llm                       # the same weights, compiled apart: a good draft
    tok = Tokenizer(llm.tokenizer_files)
    s = Server([f"tiny={path}", "--draft", f"tiny={draft_path}"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0, timeout=30)
        cases = [("Hi", 10), ("abc", 25), ("x", 3), ("Hello", 17), ("Zz", 9), ("42", 21)]
        want = [tok.decode(_solo(llm, tok.encode(p), n, GREEDY, stops=(2,)).tokens) for p, n in cases]

        def ask(case):
            chunks = list(client.completions.create(model="tiny", prompt=case[0], max_tokens=case[1],
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, cases))
        assert [text for text, _ in answers] == want
        details = [u.completion_tokens_details for _, u in answers]
        accepted = sum(d.accepted_prediction_tokens for d in details)
        proposed = accepted + sum(d.rejected_prediction_tokens for d in details)
        assert 0 < accepted <= proposed
        status, _, text = s.request("GET", "/metrics")
        text = text.decode()

        def metric(name):
            found = re.search(rf'^{name}{{model="tiny"}} (\S+)$', text, re.M)
            assert status == 200 and found, (name, text[-2000:])
            return float(found.group(1))
        assert (metric("kiln_llm_draft_tokens_accepted"), metric("kiln_llm_draft_tokens_proposed")) == (accepted,
                                                                                                     proposed)
        assert metric("kiln_llm_draft_acceptance_ratio") == pytest.approx(accepted / proposed)
    finally:
        s.stop()
