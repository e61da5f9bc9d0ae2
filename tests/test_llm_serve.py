"""``kiln serve`` on an LLM artifact: the OpenAI API over a real loopback socket, driven by
the real ``openai`` client, answers equal to the same requests run alone in-process."""
import asyncio
import concurrent.futures
import json
import os
import re
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.runtime.sampling import SamplingParams  # noqa: E402
from kiln.runtime.scheduler import Request  # noqa: E402
from kiln.runtime.text import Tokenizer  # noqa: E402
from tests.test_serve import Server  # noqa: E402

EOS = 2          # tests/conftest.py's tiny tokenizer's </s>


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    _, llm, path = tiny_llm
    s = Server([f"tiny={path}"], tmp_path_factory.mktemp("llm-serve") / "server.log")
    yield s, llm, Tokenizer(llm.tokenizer_files)
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    s, _, _ = served
    return openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0, timeout=30)


def solo(llm, prompt, n, params=SamplingParams(), stops=(EOS,)):
    sched = llm.scheduler()
    r = sched.add(Request(prompt, n, params, stops))
    sched.run()
    return r.tokens, r.finish_reason


def test_models_completion_and_chat_equal_the_request_run_alone(served, client):
    _, llm, tok = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tokens, reason = solo(llm, tok.encode("Hi"), 10)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, temperature=0)
    assert out.choices[0].text == tok.decode(tokens)
    assert out.choices[0].finish_reason == reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, len(tokens))
    messages = [{"role": "user", "content": "Hey"}]
    prompt = tok.encode_chat(messages)
    assert prompt == tok.encode("u:Hey\na:", add_special_tokens=False)
    tokens, reason = solo(llm, prompt, 16)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == tok.decode(tokens)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == reason
    # sampled with a seed: the same as the in-process run with the same settings
    params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, top_k=20, seed=5)
    tokens, _ = solo(llm, tok.encode("Hi"), 12, params)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0.8, top_p=0.9,
                                    seed=5, extra_body={"top_k": 20})
    assert out.choices[0].text == tok.decode(tokens)


def test_streaming_deltas_add_up_to_the_whole_answer_with_usage(served, client):
    _, llm, tok = served
    whole = client.completions.create(model="tiny", prompt="ab", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="ab", max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    messages = [{"role": "user", "content": "x"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_end_the_answer_before_them_streamed_or_not(served, client):
    _, llm, tok = served
    tokens, _ = solo(llm, tok.encode("Q"), 24, stops=())
    text = tok.decode(tokens)
    stop = text[6:8]                       # two characters from the middle of the answer
    want = text[:text.index(stop)]
    out = client.completions.create(model="tiny", prompt="Q", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt="Q", max_tokens=24, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == want


def test_eight_concurrent_clients_each_get_their_solo_answer(served, client):
    _, llm, tok = served
    cases = [("Hi", 10), ("abc", 25), ("x", 3), ("Hello", 17), ("Zz", 9), ("42", 21), ("ok", 5), ("q?", 14)]
    want = [tok.decode(solo(llm, tok.encode(p), n)[0]) for p, n in cases]

    def ask(case):
        p, n = case
        return client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, cases)) == want


def test_bad_requests_get_openai_errors(served, client):
    s, _, _ = served
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="longer than the largest context bucket \\(8\\)"):
        client.completions.create(model="tiny", prompt="a very long prompt", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="exceed the compiled cache of 32"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=40)
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a number >= 0"):
        client.completions.create(model="tiny", prompt="Hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="'presence_penalty' = 0.5 is not supported"):
        client.completions.create(model="tiny", prompt="Hi", presence_penalty=0.5)
    status, body = s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "colour": "red"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "colour" in body["error"]["message"]
    status, body = s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream_options": "x"})
    assert status == 400 and "'stream_options' must be an object" in body["error"]["message"]
    status, body = s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "stream": True,
                                                   "stream_options": {"include_usage": "no"}})     # was read as true
    assert status == 400 and "'include_usage' must be true or false" in body["error"]["message"], body
    status, body = s.post_json("/v1/chat/completions", {"model": "tiny", "messages": "Hi"})
    assert status == 400 and "'messages' must be a non-empty list" in body["error"]["message"]
    status, body = s.post_json("/v2/models/tiny/infer", {"inputs": []})
    assert status == 400 and "is an LLM" in body["error"]
    status, _, raw = s.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]


def test_metrics_report_tokens_latency_and_the_kv_cache(served, client):
    s, _, _ = served
    client.completions.create(model="tiny", prompt="m", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    status, text = s.get("/metrics")
    text = text.decode()
    assert status == 200

    def value(name):
        found = re.search(rf'^{name}{{model="tiny"}} (\S+)$', text, re.M)
        assert found, name
        return float(found.group(1))
    assert value("kiln_llm_time_to_first_token_seconds_count") >= 1
    assert value("kiln_llm_inter_token_latency_seconds_count") >= 4
    assert value("kiln_llm_generated_tokens_total") >= 5
    assert value("kiln_llm_tokens_per_second") > 0
    assert value("kiln_llm_kv_cache_usage_ratio") == 0          # nothing running now
    assert value("kiln_serve_queue_depth") == 0
    assert 'kiln_llm_generations_finished_total{model="tiny",reason="length"}' in text


def test_a_full_queue_gets_429_at_once(tiny_llm, tmp_path):
    """A flood of 30 clients on a queue of 1: the answers each equal to the request run alone,
    the rest a 429 at once; ``n`` over the queue's size is a 400 (it could never be queued)."""
    _, llm, path = tiny_llm
    s = Server([f"tiny={path}", "--max-queue", "1"], tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        tok = Tokenizer(llm.tokenizer_files)
        want = tok.decode(solo(llm, tok.encode("Hi"), 28, stops=())[0])

        def ask(_):
            started = time.perf_counter()
            try:
                out = c.completions.create(model="tiny", prompt="Hi", max_tokens=28, temperature=0,
                                           extra_body={"ignore_eos": True})
                return out.choices[0].text, time.perf_counter() - started
            except openai.RateLimitError as e:
                return e, time.perf_counter() - started

        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            results = list(pool.map(ask, range(30)))
        refused = [t for r, t in results if isinstance(r, openai.RateLimitError)]
        answered = [r for r, _ in results if isinstance(r, str)]
        assert refused and len(answered) >= 4, (len(refused), len(answered))
        assert all(r == want for r in answered)
        assert all("already waiting" in str(r) for r, _ in results if not isinstance(r, str))
        assert s.get("/v2/health/ready")[0] == 200
        # more choices than the queue can ever hold: a 400 naming the setting, not a 429 forever
        for _ in range(2):
            with pytest.raises(openai.BadRequestError, match="n = 2 choices exceed .*--max-queue 1") as e:
                c.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=2)
            assert e.value.body["param"] == "n"
        assert c.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=1).usage.completion_tokens >= 1
    finally:
        s.stop()


# ``kiln serve``'s own entry point, with one change made by the test: the models start
# loading only once the gate file exists, so the test holds the loading window open as long
# as it needs (a big model takes seconds there; the tiny one takes milliseconds)
GATED_SERVE = """
import os, sys, time
from kiln.serving.repository import ServerState
from kiln.serving.server import main

gate, argv = sys.argv[1], sys.argv[2:]
load_all = ServerState.load_all

def gated_load_all(self):
    while not os.path.exists(gate):
        time.sleep(0.02)
    load_all(self)

ServerState.load_all = gated_load_all
sys.exit(main(argv))
"""


class GatedServer(Server):
    """``kiln serve`` whose models load once ``gate`` exists; listening before that."""

    def __init__(self, args, log_path, gate):
        self.gate = gate
        super().__init__(args, log_path, command=[sys.executable, "-c", GATED_SERVE, str(gate)],
                         ready=lambda: True, what="listen")


def test_a_model_is_listed_only_once_it_answers(tiny_llm, tmp_path):
    """A client that polls /v1/models until the model appears, then sends one chat completion
    over plain HTTP with no retries, gets its answer: never the 503 of a model still loading.
    While the models load, nothing is listed, the health endpoints and both models' KServe
    ready endpoints say 503 with Retry-After, and so does a request sent anyway."""
    import kiln
    import torch
    _, llm, path = tiny_llm
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    kiln.trace(mlp, torch.randn(2, 16), dynamic_batch=True, compiler_args="-O1").save(tmp_path / "mlp.kiln")
    tok = Tokenizer(llm.tokenizer_files)
    messages = [{"role": "user", "content": "Hey"}]
    want = tok.decode(solo(llm, tok.encode_chat(messages), 16)[0])
    chat = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0}
    x = torch.randn(1, 16)
    infer = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": x.flatten().tolist()}]}
    s = GatedServer([f"tiny={path}", tmp_path / "mlp.kiln"], tmp_path / "server.log", tmp_path / "gate")
    try:
        answer = {}

        def poll_then_ask():            # a script or a load balancer: poll the list, then one request
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status, _, body = s.call("GET", "/v1/models")
                if status == 200 and "tiny" in [m["id"] for m in body["data"]]:
                    break
                time.sleep(0.02)
            answer["chat"] = s.call("POST", "/v1/chat/completions", chat)

        client = threading.Thread(target=poll_then_ask)
        client.start()
        loading = {p: s.call("GET", p) for p in ("/v1/models", "/health", "/v2/health/ready", "/v2/health/live",
                                                 "/v2/models/tiny/ready", "/v2/models/mlp/ready",
                                                 "/v2/models/mlp")}
        loading["index"] = s.call("POST", "/v2/repository/index")
        loading["infer"] = s.call("POST", "/v2/models/mlp/infer", infer)
        loading["chat"] = s.call("POST", "/v1/chat/completions", chat)
        assert not os.path.exists(s.gate) and not any(e.get("event") == "model_loading" for e in s.events())
        s.gate.touch()                  # the models load now
        client.join(180)
        status, headers, body = answer["chat"]
        assert status == 200, (status, body)
        assert body["choices"][0]["message"]["content"] == want
        # while loading: nothing listed, not ready (503 + Retry-After), the requests refused likewise
        assert loading["/v1/models"][0] == 200 and loading["/v1/models"][2]["data"] == []
        assert loading["/v2/health/live"][0] == 200
        for key in ("/health", "/v2/health/ready", "/v2/models/tiny/ready", "/v2/models/mlp/ready",
                    "/v2/models/mlp", "infer", "chat"):
            status, headers, body = loading[key]
            assert status == 503 and headers.get("retry-after") == "1", (key, status, headers, body)
        assert {m["name"]: m["state"] for m in loading["index"][2]} == {"tiny": "LOADING", "mlp": "LOADING"}
        # once listed, ready everywhere orchestrators look
        status, _, body = s.call("GET", "/v1/models")
        assert [m["id"] for m in body["data"]] == ["tiny"]
        deadline = time.monotonic() + 60   # the models load one after another: mlp may come second
        while s.call("GET", "/v2/health/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in ("/health", "/v2/health/ready", "/v2/models/tiny/ready", "/v2/models/mlp/ready"):
            assert s.call("GET", p)[0] == 200, p
        assert {m["name"]: m["state"] for m in s.call("POST", "/v2/repository/index")[2]} == {
            "tiny": "READY", "mlp": "READY"}
        status, _, body = s.call("POST", "/v2/models/mlp/infer", infer)
        assert status == 200
        torch.testing.assert_close(torch.tensor(body["outputs"][0]["data"]).reshape(1, 4), mlp(x),
                                   atol=1e-4, rtol=1e-4)
    finally:
        s.gate.touch()
        s.stop()


def test_every_503_carries_retry_after_and_a_429_too():
    """The app's middleware adds Retry-After to a 503 of any handler that did not set one, keeps
    one that did, and leaves other statuses alone; the OpenAI errors for a full queue (429) and
    a model not ready (503) carry it themselves."""
    from kiln.serving.app import RetryAfter
    from kiln.serving.openai_api import OpenAIError

    def answered(status, headers):
        async def inner(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"{}"})
        sent = []

        async def send(message):
            sent.append(message)
        asyncio.run(RetryAfter(inner)({"type": "http"}, None, send))
        return [(k.lower(), v) for k, v in sent[0]["headers"] if k.lower() == b"retry-after"]

    assert answered(503, [(b"content-type", b"application/json")]) == [(b"retry-after", b"1")]
    assert answered(503, [(b"Retry-After", b"7")]) == [(b"retry-after", b"7")]
    assert answered(200, []) == [] and answered(500, []) == [] and answered(429, []) == []
    assert OpenAIError(503, "loading", "service_unavailable").response().headers["retry-after"] == "1"
    assert OpenAIError(429, "full", "rate_limit_exceeded").response().headers["retry-after"] == "1"
    assert "retry-after" not in OpenAIError(400, "bad").response().headers


def test_the_draining_log_counts_an_llms_generations(tiny_llm, caplog):
    """At SIGTERM the server logs what is still to finish; it counted the inference
    endpoints' requests only, so a server with four chats streaming logged
    ``in_flight: 0``. The generations an LLM's scheduler runs or holds are counted too."""
    import logging
    from kiln.serving.repository import ServerState
    from kiln.serving.settings import ServeConfig
    _, llm, _ = tiny_llm
    state = ServerState({"tiny": llm}, ServeConfig())
    (sm,) = state.models.values()
    sm.load()
    for prompt in ([5, 6], [7], [8, 9, 10]):
        sm.scheduler.add(Request(prompt, 4, SamplingParams(), (EOS,)))
    sm.scheduler.step()                     # admitted: running, not finished
    assert state.generations() == 3
    with caplog.at_level(logging.INFO, logger="kiln.serve"):
        state.begin_drain()
    (record,) = [r for r in caplog.records if r.getMessage() == "draining"]
    assert record.fields == {"in_flight": 0, "generations": 3}
