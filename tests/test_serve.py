"""kiln serve: the Open Inference Protocol over HTTP, checked with tritonclient and raw HTTP.

Two server subprocesses on loopback ports, one per fixture:

* ``server``: a dynamic-batch MLP and a bucketed sequence model (dynamic batch over
  buckets 4 and 8), 2 instances, batching on (max batch 8, 20 ms delay).
* ``slow``: the MLP with a 1.5 s batching delay and a queue of 4, so requests stay
  queued long enough to overload it, time them out and SIGTERM it with work in flight.
"""
import gzip
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import kiln
from kiln.host import cores as placement

from . import forkserver
from .conftest import ROOT

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

ATOL = RTOL = 1e-5


class SeqModel(torch.nn.Module):
    """Per-position linear layer, masked, plus a masked mean: padding-safe like attention."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, mask):
        y = self.lin(x) * mask.unsqueeze(-1)
        return {"tokens": y, "pooled": y.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    kiln.trace(mlp, torch.randn(4, 16), dynamic_batch=True, name="mlp").save(d / "mlp.kiln")
    seq = SeqModel().eval()
    kiln.trace(seq, {"x": torch.randn(2, 8, 8), "mask": torch.ones(2, 8)}, buckets={"x": {1: [4, 8]}},
               pad_values={"mask": 0}, dynamic_batch=True, name="seq").save(d / "seq.kiln")
    return {"dir": d, "mlp": mlp, "seq": seq}


class Server:
    """``kiln serve`` (the console script) on a free loopback port; logs (JSON lines) go to a file."""

    def __init__(self, args, log_path, command=None, ready=None, what="become ready"):
        """``command``: what runs instead of the console script's ``kiln serve`` (a script
        holding the server at some step); ``ready()``: when to return once it listens (by
        default when /v2/health/ready says 200)."""
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        env = dict(os.environ, KILN_QUIET="1", PYTHONPATH=ROOT)
        command = command or [os.path.join(os.path.dirname(sys.executable), "kiln"), "serve"]
        self.proc = forkserver.popen([*command, *map(str, args), "--host", "127.0.0.1", "--port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=self.log_file, cwd=ROOT, env=env)
        ready = ready or (lambda: self.get("/v2/health/ready")[0] == 200)
        self.port = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.port is None:
                listening = [e for e in self.events() if e.get("event") == "listening"]
                if listening:
                    self.port = listening[0]["port"]
            if self.port is not None and ready():
                break
            time.sleep(0.05)
        else:
            self.stop()
            raise RuntimeError(f"server did not {what}:\n{open(log_path).read()[-3000:]}")
        self.url = f"127.0.0.1:{self.port}"

    def call(self, method, path, payload=None):
        """(status, headers with lower-case names, JSON body) over plain HTTP: one try."""
        body = None if payload is None else json.dumps(payload).encode()
        status, headers, raw = self.request(method, path, body, {"Content-Type": "application/json"}, 60)
        return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw) if raw else None

    def events(self):
        out = []
        with open(self.log_path) as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line))
        return out

    def request(self, method, path, body=None, headers=None, timeout=30):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def get(self, path):
        try:
            status, _, body = self.request("GET", path, timeout=5)
            return status, body
        except OSError:
            return None, b""

    def post_json(self, path, payload, timeout=30):
        status, headers, body = self.request("POST", path, json.dumps(payload).encode(),
                                             {"Content-Type": "application/json"}, timeout)
        return status, json.loads(body) if body else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()


@pytest.fixture(scope="module")
def server(artifacts):
    d = artifacts["dir"]
    s = Server([d / "mlp.kiln", f"seq={d / 'seq.kiln'}", "--instances", "2", "--max-batch-size", "8",
                "--max-queue-delay-ms", "20"], d / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow(artifacts):
    d = artifacts["dir"]
    s = Server([d / "mlp.kiln", "--max-batch-size", "64", "--max-queue-delay-ms", "1500",
                "--max-queue", "4", "--timeout", "20"], d / "slow.log")
    yield s
    s.stop()


def mlp_eager(artifacts, x):
    with torch.no_grad():
        return artifacts["mlp"](torch.from_numpy(x)).numpy()


def seq_eager(artifacts, x, mask):
    with torch.no_grad():
        out = artifacts["seq"](torch.from_numpy(x), torch.from_numpy(mask))
    return out["tokens"].numpy(), out["pooled"].numpy()


def mlp_inputs(x, binary=True):
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return [inp]


def seq_inputs(x, mask):
    a = httpclient.InferInput("x", list(x.shape), "FP32")
    a.set_data_from_numpy(x)
    b = httpclient.InferInput("mask", list(mask.shape), "FP32")
    b.set_data_from_numpy(mask)
    return [a, b]


def seq_data(rng, batch, length, real=None):
    x = rng.standard_normal((batch, length, 8)).astype(np.float32)
    mask = np.ones((batch, length), np.float32)
    if real is not None:
        mask[-1, real:] = 0
    return x, mask


# -- the batcher's merging rules, in process ------------------------------------------------------
def test_merge_pads_within_a_bucket_and_splits_back(artifacts):
    from kiln.serving.layout import Layout, layout_of
    from kiln.serving.merging import Request, merge, split
    model = kiln.load(artifacts["dir"] / "seq.kiln")
    lay = layout_of(model)
    assert lay.batchable and [ax.sizes for ax in lay.axes] == [[4, 8]]
    assert lay.input_var == [{0, 1}, {0, 1}] and lay.output_var == [{0, 1}, {0}]
    rng = np.random.default_rng(6)
    reqs, data = [], []
    for batch, length in ((1, 5), (2, 8), (1, 7)):          # all in bucket 8
        x, mask = seq_data(rng, batch, length, real=length - 1)
        flat = [torch.from_numpy(x), torch.from_numpy(mask)]
        sizes = lay.sizes(flat)
        reqs.append(Request(flat, batch, sizes, lay.key(sizes), None, 0.0))
        data.append((x, mask))
    assert {r.key for r in reqs} == {(8,)} and lay.key((3,)) == (4,)
    flat, targets = merge(reqs, lay)
    assert targets == [8] and flat[0].shape == (4, 8, 8) and flat[1][0, 5:].eq(0).all()  # mask padded with 0
    for outs, (x, mask) in zip(split(model.run_flat(flat), reqs, lay, targets), data):
        tokens, pooled = seq_eager(artifacts, x, mask)
        assert outs[0].shape == tokens.shape
        np.testing.assert_allclose(outs[0].numpy(), tokens, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(outs[1].numpy(), pooled, atol=ATOL, rtol=RTOL)
    # a bucketed batch dim: fit trims to a filled bucket; choose pads up only when measured
    # latencies say padding costs less per real row (and tries an unmeasured bucket once)
    bucketed_batch = Layout([{0}], [{0}], [True], [True], max_rows=16, batch_sizes=[1, 4, 16])
    assert [bucketed_batch.fit(n) for n in (1, 3, 4, 7, 16)] == [1, 1, 4, 4, 16]
    assert [bucketed_batch.bucket_rows(n) for n in (1, 3, 4, 7, 16)] == [1, 4, 4, 16, 16]
    flat_cost = {1: 0.010, 4: 0.020, 16: 0.100}.get        # batching pays: 5 ms/row at 4
    linear_cost = {1: 0.010, 4: 0.040, 16: 0.160}.get      # no gain from batching
    assert [bucketed_batch.choose(n, flat_cost) for n in (1, 3, 4, 7, 16)] == [1, 3, 4, 4, 16]
    assert [bucketed_batch.choose(n, linear_cost) for n in (1, 3, 4, 7, 16)] == [1, 1, 4, 4, 16]
    assert bucketed_batch.choose(3, lambda b: None) == 3 and bucketed_batch.choose(3, {1: 0.01}.get) == 3
    assert bucketed_batch.choose(3, {4: 0.05}.get) == 1
    assert layout_of(kiln.load(artifacts["dir"] / "mlp.kiln")).fit(7) == 7


# -- tritonclient: health, metadata, inference --------------------------------------------------
def test_health_and_metadata_with_tritonclient(server):
    c = httpclient.InferenceServerClient(server.url)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("mlp") and c.is_model_ready("seq")
    assert not c.is_model_ready("nope")
    assert c.get_server_metadata()["name"] == "kiln"
    meta = c.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "output0", "datatype": "FP32", "shape": [-1, 4]}]
    meta = c.get_model_metadata("seq")     # named on the command line; bucketed dim -> -1
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, -1, 8]},
                              {"name": "mask", "datatype": "FP32", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "tokens", "datatype": "FP32", "shape": [-1, -1, 4]},
                               {"name": "pooled", "datatype": "FP32", "shape": [-1, 4]}]
    config = c.get_model_config("mlp")
    assert config["max_batch_size"] == 8 and config["instance_group"][0]["count"] == 2
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.get_model_metadata("nope")
    c.close()


def test_infer_binary_and_json_match_eager(server, artifacts):
    c = httpclient.InferenceServerClient(server.url)
    rng = np.random.default_rng(1)
    for batch in (1, 3, 4, 9):                       # 9 > the compiled batch 4: chunked
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        want = mlp_eager(artifacts, x)
        res = c.infer("mlp", mlp_inputs(x, binary=True))          # binary in, binary out
        np.testing.assert_allclose(res.as_numpy("output0"), want, atol=ATOL, rtol=RTOL)
        res = c.infer("mlp", mlp_inputs(x, binary=False),           # JSON in, JSON out
                      outputs=[httpclient.InferRequestedOutput("output0", binary_data=False)],
                      request_id="r-7", model_version="1")
        assert res.get_response()["outputs"][0]["data"] and res.get_response()["id"] == "r-7"
        np.testing.assert_allclose(res.as_numpy("output0"), want, atol=ATOL, rtol=RTOL)
    c.close()


def test_bucketed_sequences_of_any_length_match_eager(server, artifacts):
    c = httpclient.InferenceServerClient(server.url)
    rng = np.random.default_rng(2)
    for batch, length in ((1, 3), (2, 4), (3, 5), (1, 8), (2, 7)):
        x, mask = seq_data(rng, batch, length, real=max(1, length - 2))
        tokens, pooled = seq_eager(artifacts, x, mask)
        res = c.infer("seq", seq_inputs(x, mask))
        assert res.as_numpy("tokens").shape == (batch, length, 4)    # sliced back to its length
        np.testing.assert_allclose(res.as_numpy("tokens"), tokens, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(res.as_numpy("pooled"), pooled, atol=ATOL, rtol=RTOL)
        # only the requested output comes back
        res = c.infer("seq", seq_inputs(x, mask), outputs=[httpclient.InferRequestedOutput("pooled")])
        assert [o["name"] for o in res.get_response()["outputs"]] == ["pooled"]
    c.close()


def _histogram(metrics_text, name, model):
    """{le: cumulative count} of a histogram for one model."""
    out = {}
    for m in re.finditer(rf'^{name}_bucket\{{le="([^"]+)",model="{model}"\}} (\S+)$', metrics_text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_concurrent_clients_get_their_own_results_under_dynamic_batching(server, artifacts):
    before = _histogram(server.get("/metrics")[1].decode(), "kiln_serve_batch_size", "seq")
    c = httpclient.InferenceServerClient(server.url, concurrency=16)
    rng = np.random.default_rng(3)
    jobs = []
    for k in range(96):
        if k % 2:
            x = rng.standard_normal((1 + k % 3, 16)).astype(np.float32)
            jobs.append(("mlp", (x,), c.async_infer("mlp", mlp_inputs(x))))
        else:       # lengths 2..8: two buckets, padded within each group and sliced back
            x, mask = seq_data(rng, 1 + k % 2, 2 + k % 7, real=1 + k % 3)
            jobs.append(("seq", (x, mask), c.async_infer("seq", seq_inputs(x, mask))))
    for model, inputs, job in jobs:
        res = job.get_result(timeout=60)
        if model == "mlp":
            np.testing.assert_allclose(res.as_numpy("output0"), mlp_eager(artifacts, *inputs),
                                       atol=ATOL, rtol=RTOL)
        else:
            tokens, pooled = seq_eager(artifacts, *inputs)
            np.testing.assert_allclose(res.as_numpy("tokens"), tokens, atol=ATOL, rtol=RTOL)
            np.testing.assert_allclose(res.as_numpy("pooled"), pooled, atol=ATOL, rtol=RTOL)
    c.close()
    after = _histogram(server.get("/metrics")[1].decode(), "kiln_serve_batch_size", "seq")
    batches = after["+Inf"] - before.get("+Inf", 0)
    singles = after["1.0"] - before.get("1.0", 0)
    assert batches < 48, "requests were not merged into batches"
    assert batches - singles > 0, "no batch had more than one row"


# -- raw HTTP: errors --------------------------------------------------------------------------------
def _mlp_request(x, **extra):
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}], **extra}


def test_bad_requests_get_400_with_a_protocol_error(server):
    x = np.ones((2, 16), np.float32)
    path = "/v2/models/mlp/infer"
    cases = [
        ({"inputs": [{"name": "inp", "shape": [2, 16], "datatype": "FP32", "data": [0] * 32}]},
         "unknown input 'inp'"),
        ({"inputs": [{"name": "input", "shape": [2, 15], "datatype": "FP32", "data": [0] * 30}]},
         r"expected shape \[-1, 16\]"),
        ({"inputs": [{"name": "input", "shape": [2, 16], "datatype": "INT64", "data": [0] * 32}]},
         "expected datatype FP32"),
        ({"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32", "data": [0] * 31}]},
         "needs 32 values"),
        ({"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32", "data": ["a"] * 32}]},
         "cannot read 'data'"),
        ({"inputs": []}, "non-empty 'inputs'"),
        ({"outputs": [{"name": "output0"}], "inputs": "x"}, "non-empty 'inputs'"),
        (_mlp_request(x, outputs=[{"name": "nope"}]), "unknown output 'nope'"),
        (_mlp_request(x, outputs=[{"name": "output0"}, {"name": "output0"}]), "'output0' is requested twice"),
        (_mlp_request(x, parameters={"timeout": -1}), "timeout"),
    ]
    for payload, message in cases:
        status, body = server.post_json(path, payload)
        assert status == 400, (payload, body)
        assert re.search(message, body["error"]), body
    # "outputs": [] asks for every output, as no "outputs" does (it answered none until 12-03)
    status, body = server.post_json(path, _mlp_request(x, outputs=[]))
    assert status == 200 and [o["name"] for o in body["outputs"]] == ["output0"], body
    # malformed bodies
    status, _, body = server.request("POST", path, b'{"inputs": [', {"Content-Type": "application/json"})
    assert status == 400 and "malformed JSON" in json.loads(body)["error"]
    header = json.dumps({"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 128}}]}).encode()
    status, _, body = server.request("POST", path, header + x.tobytes()[:100],
                                     {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "runs past the end" in json.loads(body)["error"]
    status, _, body = server.request("POST", path, header + x.tobytes(),
                                     {"Inference-Header-Content-Length": "99999"})
    assert status == 400 and "outside the body" in json.loads(body)["error"]
    # compressed bodies: gzip is read; truncated or over-inflating ones are refused
    good = json.dumps(_mlp_request(x)).encode()
    status, _, body = server.request("POST", path, gzip.compress(good), {"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(body)["outputs"][0]["shape"] == [2, 4]
    status, _, body = server.request("POST", path, gzip.compress(good)[:-12], {"Content-Encoding": "gzip"})
    assert status == 400 and "truncated" in json.loads(body)["error"]
    bomb = gzip.compress(b" " * (65 << 20))   # 65 MiB of spaces: over the 64 MiB limit once inflated
    status, _, body = server.request("POST", path, bomb, {"Content-Encoding": "gzip"})
    assert status == 400 and "inflates past the limit" in json.loads(body)["error"]
    # a bucketed input longer than the largest bucket
    status, body = server.post_json("/v2/models/seq/infer", {"inputs": [
        {"name": "x", "shape": [1, 9, 8], "datatype": "FP32", "data": [0.0] * 72},
        {"name": "mask", "shape": [1, 9], "datatype": "FP32", "data": [1.0] * 9}]})
    assert status == 400 and "larger than the largest bucket" in body["error"]
    # unknown model or version: 404
    status, body = server.post_json("/v2/models/nope/infer", _mlp_request(x))
    assert status == 404 and "unknown model 'nope'" in body["error"]
    status, body = server.post_json("/v2/models/mlp/versions/2/infer", _mlp_request(x))
    assert status == 404 and "no version '2'" in body["error"]
    status, body = server.get("/v2/models/nope")
    assert status == 404 and "error" in json.loads(body)
    # the server is fine afterwards
    assert server.get("/v2/health/ready")[0] == 200
    status, body = server.post_json(path, _mlp_request(x))
    assert status == 200 and body["outputs"][0]["shape"] == [2, 4]


def test_bad_requests_do_not_disturb_good_ones_in_flight(server, artifacts):
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(24)]
    results = {}

    def good(k):
        x = inputs[k]
        status, body = server.post_json("/v2/models/mlp/infer", _mlp_request(x))
        results[k] = (status, body, x)

    def bad(k):
        results[k] = (*server.post_json("/v2/models/mlp/infer", {"inputs": [
            {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 15}]}), None)

    threads = [threading.Thread(target=good if k % 2 else bad, args=(k,)) for k in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 24
    for status, body, x in results.values():
        if x is None:
            assert status == 400 and "needs 16 values" in body["error"]
        else:
            assert status == 200, body
            got = np.array(body["outputs"][0]["data"], np.float32).reshape(1, 4)
            np.testing.assert_allclose(got, mlp_eager(artifacts, x), atol=ATOL, rtol=RTOL)


def test_json_data_is_read_as_sent_or_refused(server, artifacts):
    """Nested data must follow the shape (ragged rows were re-split into it), and a float
    input takes numbers, not true/false (true was read as 1.0): no implicit casts."""
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 32
    flat = x.reshape(-1).tolist()
    path = "/v2/models/mlp/infer"
    for data, message in (([flat[:20], flat[20:]], r"input 'input': .*ragged.*list 1 has 12 values, list 0 has 20"),
                          ([flat[:16], flat[16:], []], r"input 'input': .*ragged"),
                          ([flat[:16], 1.0], r"input 'input': .*ragged"),
                          ([[v] for v in flat], r"input 'input': .*dims \[32, 1\].*shape \[2, 16\]"),
                          ([flat], r"input 'input': .*dims \[1, 32\].*shape \[2, 16\]"),
                          ([True] * 32, r"input 'input': .*FP32 data must be numbers"),
                          ([1.0] * 31 + [False], r"input 'input': .*FP32 data must be numbers")):
        status, body = server.post_json(path, {"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32",
                                                           "data": data}]})
        assert status == 400 and re.search(message, body["error"]), (data, body)
    # nested as the shape (rows of 16), and integers for a float input, are read as sent
    want = mlp_eager(artifacts, x)
    for data in (x.tolist(), flat):
        status, body = server.post_json(path, {"inputs": [{"name": "input", "shape": [2, 16], "datatype": "FP32",
                                                           "data": data}]})
        assert status == 200, body
        np.testing.assert_allclose(np.array(body["outputs"][0]["data"], np.float32).reshape(2, 4), want,
                                   atol=ATOL, rtol=RTOL)
    ints = np.arange(16, dtype=np.float32).reshape(1, 16)
    status, body = server.post_json(path, {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32",
                                                       "data": list(range(16))}]})
    assert status == 200
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"], np.float32).reshape(1, 4),
                               mlp_eager(artifacts, ints), atol=ATOL, rtol=RTOL)


def test_nan_and_infinity_travel_as_json_tokens_tritonclient_reads(server, artifacts):
    """NaN and ±inf have no JSON number: in JSON data they are the tokens NaN, Infinity and
    -Infinity, which tritonclient (rapidjson) and Python's json write and read; the values
    come back as computed, never replaced."""
    x = np.ones((3, 16), np.float32)
    x[0, 3], x[1, 5], x[1, 6] = np.nan, np.inf, -np.inf
    want = mlp_eager(artifacts, x)
    assert np.isnan(want[:2]).all() and np.isfinite(want[2]).all()
    c = httpclient.InferenceServerClient(server.url)
    res = c.infer("mlp", mlp_inputs(x, binary=False),          # JSON in (NaN, Infinity), JSON out
                  outputs=[httpclient.InferRequestedOutput("output0", binary_data=False)])
    np.testing.assert_allclose(res.as_numpy("output0"), want, atol=ATOL, rtol=RTOL)     # NaN where NaN
    c.close()
    body = json.dumps(_mlp_request(x)).encode()
    status, _, raw = server.request("POST", "/v2/models/mlp/infer", body)
    assert status == 200 and b"NaN" in raw
    np.testing.assert_allclose(np.array(json.loads(raw)["outputs"][0]["data"], np.float32).reshape(3, 4), want,
                               atol=ATOL, rtol=RTOL)


def test_only_the_extensions_served_are_advertised(server):
    """The model repository extension was advertised, but tritonclient's load_model and
    unload_model got a bare 404 (as get_inference_statistics did): kiln serves its index
    only, so it advertises binary tensor data alone, and says what it does not do."""
    c = httpclient.InferenceServerClient(server.url)
    assert c.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    assert [m["name"] for m in c.get_model_repository_index()] == ["mlp", "seq"]
    for call in (lambda: c.load_model("mlp"), lambda: c.unload_model("mlp")):
        with pytest.raises(InferenceServerException, match="does not load or unload models at run time"):
            call()
    with pytest.raises(InferenceServerException, match="no statistics extension.*GET /metrics"):
        c.get_inference_statistics("mlp")
    assert c.is_model_ready("mlp")
    c.close()


# -- operations -----------------------------------------------------------------------------------------
def test_metrics_and_structured_logs(server):
    # its own traffic, so the counts below do not depend on which tests ran before it
    x = np.ones((2, 16), np.float32)
    for _ in range(10):
        assert server.post_json("/v2/models/mlp/infer", _mlp_request(x))[0] == 200
    assert server.post_json("/v2/models/mlp/infer", {"inputs": [
        {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 15}]})[0] == 400
    status, body = server.get("/metrics")
    text = body.decode()
    assert status == 200
    requests = float(re.search(r'^kiln_serve_requests_total\{model="mlp"\} (\S+)$', text, re.M).group(1))
    assert requests >= 10
    assert re.search(r'^kiln_serve_request_failures_total\{model="mlp",reason="bad_request"\} [1-9]', text, re.M)
    for name in ("kiln_serve_queue_duration_seconds", "kiln_serve_inference_duration_seconds",
                 "kiln_serve_request_duration_seconds", "kiln_serve_batch_size"):
        count = re.search(rf'^{name}_count\{{model="mlp"\}} (\S+)$', text, re.M)
        assert count and float(count.group(1)) > 0, name
    assert re.search(r'^kiln_serve_model_ready\{model="seq"\} 1\.0$', text, re.M)
    assert re.search(r'^kiln_serve_model_instances\{model="seq"\} 2\.0$', text, re.M)
    events = server.events()         # every line is a JSON object
    assert all({"ts", "level", "event"} <= set(e) for e in events)
    names = [e["event"] for e in events]
    for model in ("mlp", "seq"):      # ready only after every instance warmed up
        warm = [i for i, e in enumerate(events) if e["event"] == "instance_warmed_up" and e["model"] == model]
        ready = names.index("model_ready", min(warm))
        assert len(warm) == 2 and max(warm) < ready and events[ready]["model"] == model
    cores = {e["core"] for e in events if e["event"] == "instance_loaded"}
    assert cores <= {0, 1} and len(cores) == min(2, len(placement.visible()))


# -- overload, timeouts, SIGTERM (the slow server) ----------------------------------------------------
def test_overload_gets_503_quickly_and_server_stays_healthy(slow, artifacts):
    x = np.arange(16, dtype=np.float32).reshape(1, 16) / 16
    results = []

    def send():
        t0 = time.monotonic()
        status, body = slow.post_json("/v2/models/mlp/infer", _mlp_request(x), timeout=15)
        results.append((status, body, time.monotonic() - t0))

    threads = [threading.Thread(target=send) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] in (429, 503)]
    assert len(ok) + len(rejected) == 12, [r[:2] for r in results]
    assert len(ok) >= 4 and rejected          # the queue holds 4; the rest are turned away
    assert all("overloaded" in r[1]["error"] for r in rejected)
    assert all(r[2] < 1.2 for r in rejected)    # at once, not after the 1.5 s batching delay
    for _, body, _ in ok:
        got = np.array(body["outputs"][0]["data"], np.float32).reshape(1, 4)
        np.testing.assert_allclose(got, mlp_eager(artifacts, x), atol=ATOL, rtol=RTOL)
    assert slow.get("/v2/health/ready")[0] == 200
    status, body = slow.post_json("/v2/models/mlp/infer", _mlp_request(x))
    assert status == 200
    metrics = slow.get("/metrics")[1].decode()
    assert re.search(r'kiln_serve_request_failures_total\{model="mlp",reason="overloaded"\} [1-9]', metrics)


def test_request_timeout(slow):
    x = np.ones((1, 16), np.float32)
    t0 = time.monotonic()
    status, body = slow.post_json("/v2/models/mlp/infer", _mlp_request(x, parameters={"timeout": 200_000}))
    assert status == 504 and "timed out after 200 ms" in body["error"]
    assert time.monotonic() - t0 < 1.2
    status, body = slow.post_json("/v2/models/mlp/infer", _mlp_request(x, parameters={"timeout": 1}))
    assert status == 504 and "timed out after 1 µs" in body["error"]     # it said "0 ms"
    assert slow.get("/v2/health/live")[0] == 200


def _queue_depth(server) -> float:
    text = server.get("/metrics")[1].decode()
    return float(re.search(r'^kiln_serve_queue_depth\{model="mlp"\} (\S+)$', text, re.M).group(1))


def test_timed_out_requests_leave_the_queue_at_once(slow):
    """A request that times out leaves the queue then, and kiln_serve_queue_depth says so (it
    kept counting timed-out requests forever)."""
    x = np.ones((1, 16), np.float32)
    results = []

    def send():
        results.append(slow.post_json("/v2/models/mlp/infer", _mlp_request(x, parameters={"timeout": 300_000}))[0])

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [504] * 3
    assert _queue_depth(slow) == 0


def test_sigterm_drains_in_flight_requests(slow, artifacts):
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(3)]
    results = {}

    def send(k):
        results[k] = slow.post_json("/v2/models/mlp/infer", _mlp_request(inputs[k]), timeout=15)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.4)               # queued: the batching delay is 1.5 s
    t0 = time.monotonic()
    slow.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(20)
    assert slow.proc.wait(20) == 0
    assert time.monotonic() - t0 < 10
    for k, (status, body) in results.items():
        assert status == 200, body
        got = np.array(body["outputs"][0]["data"], np.float32).reshape(1, 4)
        np.testing.assert_allclose(got, mlp_eager(artifacts, inputs[k]), atol=ATOL, rtol=RTOL)
    names = [e["event"] for e in slow.events()]
    assert names.index("shutdown_requested") < names.index("draining") < names.index("stopped")
    assert slow.get("/v2/health/live")[0] is None       # no longer listening


class _Slow(torch.nn.Module):
    """Seconds per call by construction: thirty products with one shared 1024 x 1024 weight."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1024, 1024) / 32)

    def forward(self, x):
        for _ in range(30):
            x = torch.tanh(x @ self.w)
        return x


def test_a_request_cut_off_by_the_drain_timeout_gets_the_protocols_503(tmp_path):
    """Found by probing (12-03): a request still running when --drain-timeout passed was
    cancelled by uvicorn, its client got a plain-text 500 and the log a CancelledError traceback."""
    import kiln
    torch.manual_seed(0)
    kiln.trace(_Slow().eval(), torch.randn(8, 1024), dynamic_batch=True, optlevel=1, cache=False,
               threads=1).save(tmp_path / "s.kiln")         # compiled small: 1024 rows run in chunks of 8
    s = Server([tmp_path / "s.kiln", "--drain-timeout", "0.2", "--no-batching", "--threads", "1"],
               tmp_path / "s.log")
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "x", "shape": [1024, 1024], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(x)}}]}).encode()
    result = {}
    sender = threading.Thread(target=lambda: result.update(r=s.request(
        "POST", "/v2/models/s/infer", header + x, {"Inference-Header-Content-Length": str(len(header))},
        timeout=60)))
    try:
        sender.start()
        deadline = time.monotonic() + 30          # the request in flight: its binary body reads in ms,
        while time.monotonic() < deadline and 'kiln_serve_in_flight_requests{model="s"} 1.0' not in \
                (s.get("/metrics")[1] or b"").decode():
            time.sleep(0.02)
        time.sleep(0.1)                           # and its call (64 GFLOP, one thread: 0.6 s at the least) under way
        s.proc.send_signal(signal.SIGTERM)
        sender.join(60)
    finally:
        s.stop()
    status, headers, body = result["r"]
    assert status == 503 and headers.get("content-type") == "application/json", (status, headers, body)
    assert "shut down before this request was answered" in json.loads(body)["error"], body
    assert "Traceback" not in open(tmp_path / "s.log").read()


def test_an_unwritable_kiln_profile_is_an_error_at_start(artifacts, tmp_path):
    """Found by probing: KILN_PROFILE=/proc/nope/t.json kiln serve served, and at SIGTERM
    printed a warning that the trace was lost and exited 0. It now refuses to start."""
    (tmp_path / "a-file").write_text("not a directory")
    profile = tmp_path / "a-file" / "t.json"
    env = dict(os.environ, KILN_QUIET="1", PYTHONPATH=ROOT, KILN_PROFILE=str(profile))
    with open(tmp_path / "err", "w") as err:
        proc = forkserver.popen([os.path.join(os.path.dirname(sys.executable), "kiln"), "serve",
                                 str(artifacts["dir"] / "mlp.kiln"), "--host", "127.0.0.1", "--port", "0"],
                                stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        try:
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
    lines = (tmp_path / "err").read_text().strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("kiln serve: error: KILN_PROFILE=") and \
        "cannot be written" in lines[0] and "unset it" in lines[0], lines


@pytest.mark.parametrize("lost", [False, True])
def test_kiln_profile_is_written_when_serve_stops_and_a_lost_one_fails_the_exit_status(
        artifacts, tmp_path, monkeypatch, lost):
    """A trace that cannot be written at shutdown (its directory replaced by a file) made
    kiln serve exit 0 after a warning; the exit status now says so (2, one error line)."""
    directory = tmp_path / "profiles"
    directory.mkdir()
    monkeypatch.setenv("KILN_PROFILE", str(directory / "t.json"))
    s = Server([artifacts["dir"] / "mlp.kiln"], tmp_path / "serve.log")
    try:
        x = np.ones((1, 16), np.float32)
        assert s.post_json("/v2/models/mlp/infer", _mlp_request(x))[0] == 200
        if lost:
            directory.rmdir()
            directory.write_text("now a file")
    finally:
        s.stop()
    errors = [line for line in open(tmp_path / "serve.log") if not line.startswith("{")]
    if lost:
        assert s.proc.returncode == 2
        assert len(errors) == 1 and "KILN_PROFILE=" in errors[0] and "not written" in errors[0], errors
    else:
        assert s.proc.returncode == 0 and errors == []
        spans = json.loads((directory / "t.json").read_text())["traceEvents"]
        assert any(e["name"] == "mlp" for e in spans), spans[:3]
