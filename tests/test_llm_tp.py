"""Tensor-parallel LLMs (``compile_llm(tp_degree=2)``): tiny random Llama (9 query / 3
key-value heads: padded), Qwen2 (4 / 1: the key-value head replicated on both ranks,
attention biases) and GPT-2 (fused QKV, learned positions) give Hugging Face's greedy
tokens, batched and across context buckets; the ranks as threads of this process and as
processes on their own cores; through ``kiln serve`` with the ``openai`` client; a rank
killed mid-request fails the request and shuts the server down."""
import contextlib
import os
import signal
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import CompilerArgsError, InputError, KilnError  # noqa: E402
from kiln.llm import shard  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from kiln.runtime.loader import load  # noqa: E402
from tests.conftest import shared_compile_cache, tiny_tokenizer  # noqa: E402
from tests.test_llm_decoder import _model  # noqa: E402

# prompts of 3 and 6 tokens: context buckets 4 and 8
PROMPTS = [[5, 17, 33], [40, 2, 9, 71, 11, 60]]
NEW = 6


def _random(model_class, config):
    """A tiny random model, weights and biases drawn wide (logits far from ties), no stop token."""
    torch.manual_seed(0)
    model = model_class(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.generation_config.eos_token_id = None
    return model.eval()


def _llama_9_3():
    return _random(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=97, hidden_size=36, intermediate_size=50, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=128))


def _qwen2_kv1():
    return _random(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128))


MODELS = {"llama": _llama_9_3, "qwen2": _qwen2_kv1, "gpt2": lambda: _model("gpt2")}


@pytest.fixture(scope="module")
def built(tmp_path_factory, run_id):
    """Each family compiled once at tp 2 (the Llama with the tokenizer, for the server), its
    graphs kept in a compile cache test_dist_multihost.py shares."""
    out = {}
    root = tmp_path_factory.mktemp("tp")
    cache = shared_compile_cache(tmp_path_factory, run_id, "tp-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_URL", cache)
        _build(out, root)
    return out


def _build(out, root):
    for name, make in MODELS.items():
        model = make()
        tok = tiny_tokenizer() if name == "llama" else None
        chunk = 4 if name == "qwen2" else None          # chunked prefill and prefix reuse, at tp 2 too
        llm = compile_llm(model, tp_degree=2, batch_size=2, decode_batches=(2,), context_buckets=(4, 8),
                          cache_length=32, optlevel=1, tokenizer=tok, prefill_chunk=chunk)
        path = root / f"{name}.kiln"
        llm.save(path)
        out[name] = (model, llm, path)


def _hf(model, prompt, n):
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", list(MODELS))
def test_threads_give_hugging_faces_greedy_tokens(built, family):
    model, _, path = built[family]
    llm = load(path)
    assert llm.tp_degree == 2 and llm.meta["tp_check"]["max_abs_logit_diff"] < 1e-3
    llm.start(mode="threads")
    try:
        got = llm.generate(PROMPTS, NEW)                          # both rows batched
        assert got == [_hf(model, p, NEW) for p in PROMPTS]
        assert llm.batch_invariance["decode_rows"] == [2]
    finally:
        llm.close()


def test_chunked_prefill_prefix_reuse_and_sampling(built):
    """A prompt longer than the largest context bucket runs by chunks, a second sharing its
    prefix starts from a copy of the first's rows, and a seeded sampled request draws what
    the eager scheduler draws on the whole model."""
    from kiln.llm.decoder import DecoderStep, cache_shape
    from kiln.runtime import sampling, scheduler
    model, _, path = built["qwen2"]
    llm = load(path)
    long = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    shared = long[:9] + [1, 2, 7]
    params = sampling.SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7)
    llm.start(mode="threads")
    try:
        got = llm.generate([long, shared], NEW)
        assert got == [_hf(model, p, NEW) for p in (long, shared)]
        sampled = llm.generate([PROMPTS[1]], NEW, params=params)
    finally:
        llm.close()
    prefill = DecoderStep(model, with_cache=False, last_only=True).eval()
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    with torch.no_grad():
        eager = scheduler.generate(prefill, step, [PROMPTS[1]], NEW, cache_shape(model.config, 1, 32), params=params)
    assert sampled == eager


class _FailsWhenArmed:
    """One rank's decode graph, failing when armed: a failure on that rank only."""

    def __init__(self, graph, rank=0):
        self.graph, self.armed, self.rank = graph, False, rank

    def __call__(self, *args):
        if self.armed:
            raise RuntimeError(f"engine failure on rank {self.rank}")
        return self.graph(*args)


@pytest.fixture
def unhandled(monkeypatch):
    """Exceptions that escape a thread (what Python's thread machinery would print)."""
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_a_step_that_fails_on_rank_0_stops_the_ranks_and_never_hangs(built, unhandled):
    _, _, path = built["llama"]
    llm = load(path)
    failing = _FailsWhenArmed(llm.leader.decode[2])
    llm.leader.decode = {2: failing}
    llm.start(mode="threads")
    try:
        assert llm.batch_invariance["decode_rows"] == [2]          # every rank checked its graphs
        failing.armed = True                  # rank 1 now waits in a collective rank 0 never reaches
        with pytest.raises(RuntimeError, match="engine failure on rank 0"):
            llm.generate(PROMPTS, NEW)
        assert llm.failed and "rank 0 failed a step" in llm.failed
        for t in llm._threads:
            t.join(30)
            assert not t.is_alive()
        with pytest.raises(KilnError, match="ranks have stopped"):
            llm.generate(PROMPTS, NEW)
        assert unhandled == []          # rank 1's aborted collective is rank 0's failure, reported once
        assert llm.failed_traceback is None
    finally:
        llm.close()


def test_a_follower_thread_that_fails_is_named_as_the_cause(built, unhandled):
    """Rank 1 fails on its own: the model says rank 1 failed (not rank 0, whose collective
    was aborted after it), listeners hear it once, and nothing escapes the thread."""
    _, _, path = built["llama"]
    llm = load(path)
    llm.ranks[1] = llm._rank_loader(1)
    failing = _FailsWhenArmed(llm.ranks[1].decode[2], rank=1)
    llm.ranks[1].decode = {2: failing}
    heard = []
    llm.on_failure.append(lambda rank, code, text: heard.append((rank, code, text)))
    llm.start(mode="threads")
    try:
        assert llm.batch_invariance["decode_rows"] == [2]
        failing.armed = True
        # the request in flight fails naming rank 1 (rank 0's aborted collective named none)
        with pytest.raises(KilnError, match=r"ranks have stopped \(rank 1 failed: RuntimeError: engine failure"):
            llm.generate(PROMPTS, NEW)
        for t in llm._threads:
            t.join(30)
            assert not t.is_alive()
        assert llm.failed.startswith("rank 1 failed: RuntimeError: engine failure on rank 1"), llm.failed
        assert "engine failure on rank 1" in llm.failed_traceback
        assert heard == [(1, None, llm.failed)]
        assert unhandled == []
        with pytest.raises(KilnError, match="ranks have stopped"):
            llm.generate(PROMPTS, NEW)
    finally:
        llm.close()


def test_only_the_first_follower_process_to_die_is_the_cause(built):
    """Each follower process has a watchdog; when one dies the others' collectives
    abort and they exit too, each reporting. The first death stays the cause, told once
    (the second used to overwrite it, and the server heard of every rank)."""
    _, _, path = built["llama"]
    llm = load(path)
    heard = []
    llm.on_failure.append(lambda rank, code, text: heard.append((rank, code)))
    llm.mode, llm._channel = "processes", object()          # as if started (nothing is)
    for rank in (2, 3, 1):                     # as their watchdogs report, one after another
        llm._rank_failed(rank, -9, "tail")
    assert llm.failed == "rank 2 exited with code -9"
    assert heard == [(2, -9)]
    # every later call says so (it used to send on the dead group: gloo's 'Connection closed by
    # peer'), and so does a request rank 0's collective failed for (gloo's error its cause)
    with pytest.raises(KilnError, match=r"ranks have stopped \(rank 2 exited with code -9\); close\(\) it"):
        llm.generate(PROMPTS, NEW)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    explained = llm._explain(gloo)
    assert isinstance(explained, KilnError) and explained.__cause__ is gloo
    assert "(rank 2 exited with code -9): RuntimeError: [" in str(explained) and "load the artifact again" in str(explained)
    llm.mode = None


def test_a_model_not_ready_says_why():
    """The server's 503 for a model whose rank died said 'not ready (unavailable)', and one
    while the server drained 'not ready (ready)': it now gives the model's error, or says
    that the server is shutting down."""
    from types import SimpleNamespace

    from kiln.serving.openai_api import served_llm
    from kiln.serving.openai_params import OpenAIError
    dead = SimpleNamespace(kind="llm", ready=False, state="UNAVAILABLE",
                           error="tensor-parallel rank 1 exited with code -9")
    live = SimpleNamespace(kind="llm", ready=True, state="READY", error=None)
    for sm, draining, why in [(dead, False, "rank 1 exited with code -9"), (dead, True, "rank 1 exited with code -9"),
                              (live, True, "the server is shutting down")]:
        state = SimpleNamespace(models={"tiny": sm}, draining=draining)
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(kiln=state)))
        with pytest.raises(OpenAIError, match="not ready") as e:
            served_llm(request, {"model": "tiny"})
        assert e.value.status == 503 and why in str(e.value), str(e.value)


def test_head_plans():
    assert shard.plan_heads(9, 3, 2).how == "padded"
    plan = shard.plan_heads(9, 3, 2)
    assert plan.kv == ((0, 1), (2, -1)) and plan.q[1] == (6, 7, 8, -1, -1, -1)
    assert shard.plan_heads(4, 1, 2).kv == ((0,), (0,))
    assert shard.plan_heads(4, 1, 2).q == ((0, 1), (2, 3))
    assert shard.plan_heads(32, 4, 2).kv == ((0, 1), (2, 3))
    assert shard.plan_heads(6, 1, 4).q == ((0, 1), (2, 3), (4, 5), (-1, -1))     # 6 heads over 4 copies


def test_speculation_with_tp_is_refused_before_compiling(monkeypatch):
    """It compiled verify graphs (35-42 s for the tiny model) that no tensor-parallel run can
    use (a draft is refused when generating)."""
    import kiln.llm.tp

    def compiles(*args, **kwargs):
        raise AssertionError("compile_tp was reached")
    monkeypatch.setattr(kiln.llm.tp, "compile_tp", compiles)
    with pytest.raises(CompilerArgsError, match="speculation_length=3 with tp_degree=2"):
        compile_llm(_model("llama"), tp_degree=2, speculation_length=3, context_buckets=(4,), cache_length=16)


def test_quantize_with_tp_is_a_clear_error():
    with pytest.raises(CompilerArgsError, match="tp_degree=2"):
        compile_llm(_model("llama"), tp_degree=2, quantize="int8", context_buckets=(4,), cache_length=16)
    with pytest.raises(CompilerArgsError, match="positive integer"):
        compile_llm(_model("llama"), tp_degree=0, context_buckets=(4,), cache_length=16)


def test_speculative_decoding_is_refused_clearly(built):
    """Before any rank starts: the options went to the ranks' schedulers, which raised a
    TypeError for the unknown keyword (and the Python API's generate had no draft at all)."""
    llm = load(built["llama"][2])
    try:
        for call in (lambda: llm.generate(PROMPTS, 2, draft="ngram"), lambda: llm.scheduler(draft="ngram")):
            with pytest.raises(InputError, match="speculative decoding .* tensor-parallel"):
                call()
        assert llm.mode is None                     # nothing was started
    finally:
        llm.close()


def test_processes_pinned_to_their_cores(built):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: each rank owns a core")
    # compile_llm's own result, whose check ran the ranks as threads and closed them: its first
    # generation in processes hung for good (rank 0 kept the threads' decode plan and skipped the
    # collective probe the fresh follower ran)
    model, llm, _ = built["qwen2"]
    llm.start()
    try:
        assert llm.mode == "processes"
        done = []
        worker = threading.Thread(target=lambda: done.append(llm.generate(PROMPTS[::-1], NEW)), daemon=True)
        worker.start()
        worker.join(120)
        assert done, "the first generation in processes did not finish within 120 s"
        assert done[0] == [_hf(model, p, NEW) for p in PROMPTS[::-1]]
        children = llm._launched.pids
        mine = os.sched_getaffinity(0)
        theirs = os.sched_getaffinity(children[1])
        assert mine and theirs and not (mine & theirs)
        # a second tensor-parallel model in the same process, while these ranks run, joined
        # their world as if torchrun had made it and waited for followers that serve the first
        # model, for good (found by probing): now a clear error, and it runs once the first closes
        llama, _, path = built["llama"]
        other, done = load(path), []
        worker = threading.Thread(target=lambda: done.append(_raised(lambda: other.generate(PROMPTS, NEW))),
                                  daemon=True)
        worker.start()
        worker.join(120)
        assert done, "a second tensor-parallel model's generation did not end within 120 s"
        assert isinstance(done[0], KilnError) and "close() it" in str(done[0]) and other.mode is None, done
        assert llm.generate(PROMPTS[:1], NEW) == [_hf(model, PROMPTS[0], NEW)]     # the first still runs
    finally:
        llm.close()
    try:
        assert other.start(mode="threads").generate(PROMPTS, NEW) == [_hf(llama, p, NEW) for p in PROMPTS]
    finally:
        other.close()


def _raised(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the caller checks which
        return e


def test_served_with_the_openai_client_and_a_rank_that_dies(built, tmp_path):
    openai = pytest.importorskip("openai")
    from kiln.runtime.text import Tokenizer
    from tests.test_serve import Server
    model, llm, path = built["llama"]
    tok = Tokenizer(llm.tokenizer_files)
    server = Server([f"tiny={path}", "--stall-timeout", "1"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        prompt = tok.encode("Hi")
        out = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
        expected = _hf(model, prompt, 5)
        expected = expected[:expected.index(2) + 1] if 2 in expected else expected     # </s> ends the server's
        assert out.choices[0].text == tok.decode(expected)
        # log-probabilities through the ranks' lockstep scheduler (it once recorded none: the
        # response's logprobs came back empty): Hugging Face's log_softmax, at the sharded
        # build's logit tolerance
        from tests.test_llm_serve_api import hf_logprobs
        lp = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0,
                                       logprobs=2).choices[0].logprobs
        assert lp is not None and len(lp.token_logprobs) == len(expected)
        ref = hf_logprobs(model, prompt, expected)
        torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref[torch.arange(len(expected)), expected],
                                   atol=1e-3, rtol=0)
        assert all(len(top) == 2 for top in lp.top_logprobs)
        follower = [e for e in server.events() if e.get("event") == "model_loaded"]
        assert follower
        import psutil
        children = [c for c in psutil.Process(server.proc.pid).children() if "kiln.distributed.rank" in
                    " ".join(c.cmdline())]
        assert len(children) == 1
        # a rank that stops answering (SIGSTOP) holds the next step in a collective: /health
        # turns 503 naming the model once the step has run --stall-timeout (it stayed 200 for
        # the 30-minute collective timeout), and 200 again when the rank resumes; the request
        # then finishes with Hugging Face's tokens
        expected = _hf(model, prompt, 20)
        expected = expected[:expected.index(2) + 1] if 2 in expected else expected
        done = []
        os.kill(children[0].pid, signal.SIGSTOP)
        try:
            worker = threading.Thread(target=lambda: done.append(client.completions.create(
                model="tiny", prompt="Hi", max_tokens=20, temperature=0)), daemon=True)
            worker.start()
            deadline = time.monotonic() + 30
            while (health := server.call("GET", "/health"))[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert health[0] == 503 and health[2]["stalled"]["tiny"] >= 1, health
            assert not done                              # the request waits for the step
        finally:
            os.kill(children[0].pid, signal.SIGCONT)
        worker.join(60)
        assert done and done[0].choices[0].text == tok.decode(expected)
        assert server.call("GET", "/health")[0] == 200
        assert [e["model"] for e in server.events() if e.get("event") == "llm_stalled"] == ["tiny"]
        stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=20, temperature=0, stream=True)
        first = next(iter(stream))
        assert first.choices[0].text is not None
        os.kill(children[0].pid, signal.SIGKILL)
        with pytest.raises(Exception):
            for _ in stream:
                pass
            client.completions.create(model="tiny", prompt="Hi", max_tokens=20, temperature=0)
        assert server.proc.wait(60) is not None        # the server shut itself down
        log = open(tmp_path / "server.log").read()       # the dead rank's own output is not JSON
        assert '"event": "rank_failed"' in log or '"event":"rank_failed"' in log, log[-3000:]
    finally:
        server.stop()


def test_shutdown_with_a_stalled_rank_ends_after_the_drain_timeout(built):
    """A follower process that stops answering (SIGSTOP) while a request runs: the served
    model's close waited for the scheduler's step, stuck in a collective with it, for the
    collective timeout (30 minutes), so a server's SIGTERM never ended (found by probing).
    ``close(timeout)`` now stops the ranks once the timeout has passed: the step fails, the
    request with it, and close returns, the model's failure saying why."""
    import asyncio

    from kiln.runtime.sampling import SamplingParams
    from kiln.serving.llm import ServedLLM
    from kiln.serving.metrics import ServeMetrics
    from kiln.serving.settings import ServeConfig
    _, _, path = built["llama"]
    sm = ServedLLM("tiny", str(path), ServeConfig(), ServeMetrics())
    sm.load()
    (pid,) = sm.llm._launched.pids.values()

    async def run():
        sm.start()
        gen = sm.submit([5, 17, 3], 28, SamplingParams(), (), ())
        await gen.events.get()                          # a token came: the request is running
        os.kill(pid, signal.SIGSTOP)
        await asyncio.wait_for(sm.close(1.0), 120)
        return gen
    try:
        gen = asyncio.run(run())
        assert "does not answer" in sm.llm.failed
        assert gen.request.finish_reason not in ("length", "stop")      # it did not finish: it failed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        sm.llm.close()                                                  # reaps it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
