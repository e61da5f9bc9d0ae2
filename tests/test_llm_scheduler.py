"""Continuous batching (kiln.runtime.scheduler) over a compiled LLM: requests joining and
leaving between decode steps each get exactly the tokens they get alone."""
import threading

import pytest
import torch

pytest.importorskip("transformers")

from kiln.errors import InputError, OverloadedError  # noqa: E402
from kiln.runtime.sampling import SamplingParams  # noqa: E402
from kiln.runtime.scheduler import Request  # noqa: E402
from tests.test_llm_decoder import _hf_greedy  # noqa: E402

GREEDY = SamplingParams()
WARM = SamplingParams(do_sample=True, temperature=1.3, top_p=0.9, seed=11)
PENALTY = SamplingParams(repetition_penalty=1.4)

# (prompt, max_new_tokens, params): different lengths, both context buckets, mixed sampling
CASES = [([5, 17, 3, 88, 42, 7, 9], 12, GREEDY), ([11, 2], 20, GREEDY), ([60, 61, 62], 5, WARM),
         ([1], 17, PENALTY), ([9, 9, 9, 9, 9, 9, 9, 9], 9, GREEDY), ([4, 3, 2, 1], 14, WARM),
         ([30, 31], 3, GREEDY), ([70, 71, 72, 73, 74, 75], 24, PENALTY)]


def _solo(llm, prompt, n, params):
    s = llm.scheduler()
    r = s.add(Request(prompt, n, params))
    s.run()
    return r.tokens


def test_eight_concurrent_requests_each_equal_their_solo_run(tiny_llm):
    model, llm, _ = tiny_llm
    solo = [_solo(llm, *case) for case in CASES]
    for (prompt, n, params), tokens in zip(CASES, solo):
        assert len(tokens) == n
        if params is GREEDY:
            assert tokens == _hf_greedy(model, prompt, n), prompt
    sched = llm.scheduler()
    seen = {"rows": set(), "waiting": 0}

    def watch(request, token):
        seen["rows"].add(len(sched.active))
        seen["waiting"] = max(seen["waiting"], len(sched.waiting))
        return False

    requests = [Request(p, n, params, on_token=watch) for p, n, params in CASES]
    for r in requests[:5]:                  # five at once: three run, two wait for a slot
        sched.add(r)
    for _ in range(4):
        sched.step()
    for r in requests[5:]:                  # three more join mid-flight
        sched.add(r)
    sched.run()
    assert [r.tokens for r in requests] == solo
    assert all(r.finish_reason == "length" for r in requests)
    assert seen["rows"] >= {2, 3} and seen["waiting"] >= 1      # batching and queueing happened
    assert set(sched.rows_run) == {1, 3}          # the 1-row decode graph ran once one request was left
    assert sched.moves > 0                        # requests were moved down into freed slots
    assert sched.usage()["slots_used"] == 0 and not sched.cache.lengths.any()


def test_stop_tokens_and_listeners_end_a_request_and_free_its_slot(tiny_llm):
    _, llm, _ = tiny_llm
    full = _solo(llm, [11, 2], 20, GREEDY)
    sched = llm.scheduler()
    stop_at = Request([11, 2], 20, stop_token_ids=[full[5]])
    by_listener = Request([11, 2], 20, on_token=lambda r, t: len(r.tokens) == 3)
    sched.add(stop_at)
    sched.add(by_listener)
    sched.run()
    assert stop_at.tokens == full[:full.index(full[5]) + 1] and stop_at.finish_reason == "stop"
    assert by_listener.tokens == full[:3] and by_listener.finish_reason == "stop"


def test_first_token_reaches_its_listener_before_the_prompt_is_written_to_the_cache(tiny_llm):
    """Time to the first token does not wait for the prompt's keys and values to be copied
    into the cache; the cache gets them before the next step, and a request that ends at
    its first token leaves its row freed, its prompt kept for reuse."""
    _, llm, _ = tiny_llm
    prompt = [5, 17, 3, 88, 42, 7, 9]
    full = _solo(llm, prompt, 6, GREEDY)
    sched = llm.scheduler()
    lengths = []

    def watch(request, token):
        lengths.append(int(sched.cache.lengths[0]))
        return False

    r = sched.add(Request(prompt, 6, on_token=watch))
    sched.run()
    assert r.tokens == full
    # at the first token the row is still empty; at each later one it holds the prompt
    # and every token before the one just chosen
    assert lengths == [0] + [len(prompt) + i for i in range(1, 6)]
    one = sched.add(Request(prompt, 1))
    sched.run()
    assert one.tokens == full[:1] and one.finish_reason == "length"
    assert int(sched.cache.lengths[0]) == 0 and sched.cache.held[0][:len(prompt)] == prompt
    again = sched.add(Request(prompt, 6))
    sched.run()
    assert again.tokens == full


def test_cancel_full_queue_and_bad_requests(tiny_llm):
    _, llm, _ = tiny_llm
    sched = llm.scheduler(max_queue=2)
    a, b = sched.add(Request([1, 2], 10)), sched.add(Request([3], 10))
    with pytest.raises(OverloadedError, match="2 requests are already waiting"):
        sched.add(Request([4], 10))
    sched.cancel(b)
    sched.step()
    assert b.finish_reason == "cancelled" and b.tokens == []
    assert len(a.tokens) == 2                           # prefill's token and one decode step
    sched.cancel(a)
    sched.step()
    assert a.finish_reason == "cancelled" and sched.usage()["slots_used"] == 0
    with pytest.raises(InputError, match="longer than the largest context bucket \\(8\\)"):
        sched.add(Request(list(range(1, 10)), 2))
    with pytest.raises(InputError, match="exceed the compiled cache of 32"):
        sched.add(Request([1, 2], 31))
    with pytest.raises(InputError, match="at least one token"):
        sched.add(Request([], 3))


def test_a_failing_step_fails_its_requests_and_the_next_ones_run(tiny_llm):
    _, llm, _ = tiny_llm
    expected = _solo(llm, [5, 6], 6, GREEDY)
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("engine failed")
        return llm.decode[3](*args)

    from kiln.runtime.scheduler import Scheduler
    sched = Scheduler(llm.prefill_for, flaky, llm.meta["cache_shape"], max_context=llm.max_context)
    first = sched.add(Request([5, 6], 6))
    sched.run()
    assert first.finish_reason == "error" and "engine failed" in str(first.error)
    second = sched.add(Request([5, 6], 6))
    sched.run()
    assert second.tokens == expected and second.finish_reason == "length"


def test_background_thread_takes_requests_from_many_threads(tiny_llm):
    _, llm, _ = tiny_llm
    solo = [_solo(llm, *case) for case in CASES[:6]]
    sched = llm.scheduler()
    sched.start()
    done = [threading.Event() for _ in CASES[:6]]
    requests = [None] * 6

    def client(i):
        prompt, n, params = CASES[i]
        requests[i] = sched.add(Request(prompt, n, params, on_finish=lambda r: done[i].set()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.wait(60) for e in done)
    sched.close(timeout=10)
    assert not sched.thread.is_alive()
    assert [r.tokens for r in requests] == solo
    with pytest.raises(OverloadedError, match="shutting down"):
        sched.add(Request([1], 2))


def test_kv_cache_is_written_in_place(tiny_llm):
    _, llm, _ = tiny_llm
    sched = llm.scheduler()
    k, v = list(sched.cache.k), list(sched.cache.v)
    sched.add(Request([5, 17, 3], 6))
    sched.run()
    assert all(a is b for a, b in zip(sched.cache.k + sched.cache.v, k + v)) and k[0].abs().sum() > 0
    assert torch.equal(sched.cache.lengths, torch.zeros(3, dtype=torch.int64))


def test_a_step_that_writes_the_cache_itself_is_not_written_again(tiny_llm, monkeypatch):
    """ONNX Runtime's decode graphs write the step's keys and values into the cache they are
    given (kiln.engines.ort_gqa); the scheduler then only counts them. The cache then holds
    what a step whose new keys the scheduler writes holds (an OpenVINO-style graph, played
    here by hiding the runner's in-place writes), and the tokens are the same."""
    from kiln.runtime.kv import KVCache
    _, llm, _ = tiny_llm
    writes = []
    real = KVCache.write_slot
    monkeypatch.setattr(KVCache, "write_slot", lambda self, slot, k, v, tokens=None: (
        writes.append(k.shape[2]), real(self, slot, k, v, tokens))[1])
    graph = llm.decode[max(llm.decode)]
    assert graph.program.written_inputs(), "the tiny model's decode graph should write its cache"

    def run():
        sched = llm.scheduler()
        reqs = [sched.add(Request(p, n, GREEDY)) for p, n, _ in CASES[:3]]
        sched.run()
        n = max(int(x) for x in sched.cache.lengths) or sched.cache.window
        return [r.tokens for r in reqs], sched.cache.keys.clone(), sched.cache.values.clone(), n

    tokens, keys, values, _ = run()
    assert len(writes) == 3                                   # the three prefills only
    writes.clear()
    for program in {id(g.program): g.program for g in llm.decode.values()}.values():
        monkeypatch.setattr(program, "written_inputs", lambda: frozenset())
    tokens2, keys2, values2, _ = run()
    assert len(writes) > 3                                    # now every decode step writes too
    assert tokens2 == tokens
    assert torch.equal(keys2, keys) and torch.equal(values2, values)


def test_a_prompt_of_non_integer_token_ids_is_refused():
    """A float id was cut to an int on its way into the graph (``[1.5, 2]`` answered for
    ``[1, 2]``); integers of any kind (Python, NumPy, integer tensors) are taken."""
    import numpy as np
    for bad in ([1.5, 2], [1, True], ["3"], torch.tensor([1.0, 2.0]), [torch.tensor(2.5)]):
        with pytest.raises(InputError, match="token ids must be integers"):
            Request(bad, 3)
    for good in ([1, 2], [np.int64(1), np.int32(2)], torch.tensor([1, 2]), [torch.tensor(1), torch.tensor(2)]):
        assert Request(good, 3).prompt == [1, 2]
