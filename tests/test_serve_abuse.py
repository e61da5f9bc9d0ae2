"""kiln serve under abuse: every request gets a protocol error or a correct answer, and the
server stays healthy, with bounded memory.

One ``kiln serve`` subprocess on a loopback port (``--max-body-bytes 1M``, ``--body-timeout 3``)
serves an MLP (FP32) and an embedding model (INT64 ids, BOOL mask), both dynamic batch. Each
abuse class is sent with real clients (raw sockets, ``http.client``, ``tritonclient.http``);
after each, ``/v2/health/ready`` must be 200 and a normal request must still be answered right.
The soak mixes good and bad requests for ``seconds(ci=10, long=60)`` and bounds the server's
RSS growth (``benchmarks/reliability.py`` runs it long; figures via ``record``).
"""
import gzip
import http.client
import json
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch

import kiln

from .reliability import count, record, seconds
from .test_serve import Server

httpclient = pytest.importorskip("tritonclient.http")
psutil = pytest.importorskip("psutil")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.reliability

ATOL = RTOL = 1e-5
LIMIT = 1 << 20          # the server's --max-body-bytes
BODY_TIMEOUT = 3         # the server's --body-timeout
INFER = "/v2/models/mlp/infer"


class Emb(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, ids, mask):
        return (self.emb(ids) * mask.unsqueeze(-1).to(torch.float32)).sum(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_abuse")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    kiln.trace(mlp, torch.randn(4, 16), dynamic_batch=True).save(d / "mlp.kiln")
    emb = Emb().eval()
    ids = torch.randint(0, 50, (4, 6))
    kiln.trace(emb, {"ids": ids, "mask": torch.ones(4, 6, dtype=torch.bool)},
               dynamic_batch=True).save(d / "emb.kiln")
    return {"dir": d, "mlp": mlp, "emb": emb}


@pytest.fixture(scope="module")
def server(models):
    d = models["dir"]
    s = Server([d / "mlp.kiln", d / "emb.kiln", "--max-batch-size", "8", "--max-queue-delay-ms", "2",
                "--max-body-bytes", str(LIMIT), "--body-timeout", str(BODY_TIMEOUT)], d / "server.log")
    yield s
    s.stop()


# -- clients -------------------------------------------------------------------------------------------
def read_response(sock) -> tuple:
    """(status, headers, body) of one HTTP/1.1 response read from a raw socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a response ({buf[:200]!r})")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:n]


def raw(server, data: bytes, timeout=15) -> tuple:
    """Send raw bytes on a fresh connection and read the response."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def http_request(path, body: bytes, headers: dict, method="POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def post(server, body: bytes, headers=None, path=INFER):
    """POST with http.client (it sets Content-Length)."""
    return server.request("POST", path, body, headers or {})


def expect_error(resp, statuses=(400,), match=None):
    status, headers, body = resp
    assert status in statuses, (status, body[:300])
    assert headers.get("content-type", headers.get("Content-Type", "")).startswith("application/json"), headers
    message = json.loads(body)["error"]
    assert isinstance(message, str) and message
    if match is not None:
        assert match in message, message
    return message


def mlp_json(x) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()


def mlp_binary(x, size=None, header_length=None) -> tuple:
    """(body, headers) of a binary-data request for the MLP."""
    data = x.astype(np.float32).tobytes()
    header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(data) if size is None else size}}],
                         "parameters": {"binary_data_output": True}}).encode()
    n = len(header) if header_length is None else header_length
    return header + data, {"Inference-Header-Content-Length": str(n)}


def eager_mlp(models, x):
    with torch.no_grad():
        return models["mlp"](torch.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()


def check_mlp_answer(models, x, resp):
    status, headers, body = resp
    assert status == 200, body[:300]
    lower = {k.lower(): v for k, v in headers.items()}
    if "inference-header-content-length" in lower:
        n = int(lower["inference-header-content-length"])
        out = json.loads(body[:n])["outputs"][0]
        got = np.frombuffer(body[n:], np.float32).reshape(out["shape"])
    else:
        out = json.loads(body)["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
    np.testing.assert_allclose(got, eager_mlp(models, x), atol=ATOL, rtol=RTOL)


def assert_healthy(server, models):
    assert server.proc.poll() is None, "the server exited"
    assert server.get("/v2/health/ready")[0] == 200
    x = np.random.default_rng(99).standard_normal((2, 16)).astype(np.float32)
    check_mlp_answer(models, x, post(server, mlp_json(x)))
    body, headers = mlp_binary(x)
    check_mlp_answer(models, x, post(server, body, headers))


def server_failures(server) -> list:
    """Log lines that show the server itself failing (not a client's bad request)."""
    bad = []
    for e in server.events():
        text = json.dumps(e)
        if (e.get("level") in ("error", "critical") or "Traceback" in text
                or "Exception in ASGI" in text):
            bad.append(e)
    return bad


# -- malformed requests ------------------------------------------------------------------------------
def test_malformed_json_gets_400(server, models):
    surrogate = b'{"inputs": [{"name": "\\ud800", "shape": [1, 16], "datatype": "FP32", "data": [1]}]}'
    long_name = json.dumps({"inputs": [{"name": "x" * 200_000, "shape": [1], "datatype": "FP32",
                                        "data": [1]}]}).encode()
    deep = b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": ' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    bodies = [
        b"", b"{", b"[]", b"null", b'"inputs"', b"42", b"{}", b'{"inputs": 5}', b'{"inputs": [5]}',
        b'{"inputs": [{}]}', b"\xff\xfe\x00garbage", b'{"inputs": [{"name": "input"}]}',
        b'{"inputs": [{"name": "input", "shape": "16", "datatype": "FP32", "data": []}]}',
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": {"a": 1}}]}',
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [NaN, [1]]}]}',
        b'{"inputs": [{"name": "input", "shape": [1e400, 16], "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [{"name": "input", "shape": [99999999999999999999, 16], "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [{"name": "input", "shape": [-1, 16], "datatype": "FP32", "data": [1]}]}',
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1e999]}]}',
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [null]}]}',
        surrogate, long_name,
        json.dumps({"inputs": [{"name": f"in{k}"} for k in range(20_000)]}).encode(),
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1]}], "id": 7}',
        b'{"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [1]}], "parameters": []}',
        deep,
    ]
    for body in bodies:
        expect_error(post(server, body, {"Content-Type": "application/json"}))
    # a message that quotes the client's bytes stays valid, bounded JSON
    assert "\ud800" in expect_error(post(server, surrogate), match="unknown input")
    assert len(expect_error(post(server, long_name), match="unknown input")) < 5000
    assert_healthy(server, models)
    assert not server_failures(server)


def test_binary_extension_headers_with_bad_sizes_get_400(server, models):
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    body, good = mlp_binary(x)
    n = int(good["Inference-Header-Content-Length"])
    for value in ("-1", "abc", "1e3", "", "0x10", "99999999999999999999999", "9" * 5000, "0",
                  str(n + 1), str(n - 1), str(len(body) + 1), " 12 "):
        expect_error(post(server, body, {"Inference-Header-Content-Length": value}))
    # binary_data_size that does not match shape x datatype, or the body
    for size in (63, 65, 0, -4, "64", 64.5, True, 10**30):
        b, h = mlp_binary(x, size=size)
        expect_error(post(server, b, h))
    b, h = mlp_binary(x)
    expect_error(post(server, b + b"\0" * 8, h), match="follow the last binary input")
    expect_error(post(server, b[:-1], h))
    b2, h2 = mlp_binary(np.ones((2, 16), np.float32))
    expect_error(post(server, b2[:-64], h2))                  # shape [2, 16], one row of data
    # a JSON body with the header giving its exact length is fine
    j = mlp_json(x)
    check_mlp_answer(models, x, post(server, j, {"Inference-Header-Content-Length": str(len(j))}))
    assert_healthy(server, models)
    assert not server_failures(server)


def test_binary_bool_bytes_other_than_0_and_1_are_true(server, models):
    ids = np.array([[1, 2, 3, 4, 5, 6]], np.int64)
    mask_bytes = bytes([0, 2, 255, 1, 0, 7])
    header = json.dumps({"inputs": [
        {"name": "ids", "shape": [1, 6], "datatype": "INT64", "parameters": {"binary_data_size": 48}},
        {"name": "mask", "shape": [1, 6], "datatype": "BOOL", "parameters": {"binary_data_size": 6}}]}).encode()
    status, _, body = post(server, header + ids.tobytes() + mask_bytes,
                           {"Inference-Header-Content-Length": str(len(header))}, path="/v2/models/emb/infer")
    assert status == 200, body
    got = np.array(json.loads(body)["outputs"][0]["data"], np.float32).reshape(1, 8)
    mask = torch.tensor([[False, True, True, True, False, True]])
    with torch.no_grad():
        want = models["emb"](torch.from_numpy(ids), mask).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


# -- size limits, encodings, content types ------------------------------------------------------------
def test_bodies_over_the_limit_get_413_while_streaming(server, models):
    x = np.zeros((1, 16), np.float32)
    big = b" " * (LIMIT + 1)
    expect_error(post(server, big), statuses=(413,), match="over the limit")
    # a huge declared length is refused before any of the body is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(http_request(INFER, b"{", {"Content-Length": str(100 << 30)}))
        expect_error(read_response(sock), statuses=(413,))
    # chunked, no Content-Length: refused once the limit is passed, before the body ends
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(http_request(INFER, b"", {"Transfer-Encoding": "chunked"}))
        piece = b" " * 65536
        for _ in range(LIMIT // len(piece) + 2):
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        # the final 0-chunk is never sent: the 413 must come anyway
        expect_error(read_response(sock), statuses=(413,), match="over the limit")
    # just under the limit is read (and fails as the bad request it is)
    expect_error(post(server, b" " * (LIMIT - 10)), statuses=(400,))
    # a gzip body that inflates past the limit (a zip bomb) is refused as it inflates
    expect_error(post(server, gzip.compress(b" " * (LIMIT * 8)), {"Content-Encoding": "gzip"}),
                 match="inflates past the limit")
    assert_healthy(server, models)
    check_mlp_answer(models, x, post(server, gzip.compress(mlp_json(x)), {"Content-Encoding": "gzip"}))
    assert not server_failures(server)


def test_content_types_and_encodings(server, models):
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    body = mlp_json(x)
    # the body is JSON (or JSON + binary) whatever Content-Type says, as Triton reads it
    for ctype in ("application/json", "text/plain", "application/xml", "application/octet-stream",
                  "multipart/form-data; boundary=zzz", "garbage/;;;"):
        check_mlp_answer(models, x, post(server, body, {"Content-Type": ctype}))
    check_mlp_answer(models, x, post(server, zlib.compress(body), {"Content-Encoding": "deflate"}))
    check_mlp_answer(models, x, post(server, body, {"Content-Encoding": "identity"}))
    for enc in ("br", "compress", "gzip, gzip", "x-unknown", "zstd"):
        expect_error(post(server, body, {"Content-Encoding": enc}), match="Content-Encoding")
    for enc, data in (("gzip", body), ("deflate", body), ("gzip", gzip.compress(body)[:-12]),
                      ("deflate", zlib.compress(body)[:20]), ("gzip", b"")):
        expect_error(post(server, data, {"Content-Encoding": enc}))
    # tritonclient's own request compression
    c = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    for algorithm in ("gzip", "deflate"):
        res = c.infer("mlp", [inp], request_compression_algorithm=algorithm,
                      response_compression_algorithm=algorithm)
        np.testing.assert_allclose(res.as_numpy("output0"), eager_mlp(models, x), atol=ATOL, rtol=RTOL)
    # tritonclient gets the server's messages for bad requests
    bad = httpclient.InferInput("input", [1, 16], "FP64")
    bad.set_data_from_numpy(np.zeros((1, 16)))
    with pytest.raises(InferenceServerException, match="expected datatype FP32"):
        c.infer("mlp", [bad])
    with pytest.raises(InferenceServerException, match="unknown model"):
        c.infer("nope", [inp])
    c.close()
    assert_healthy(server, models)
    assert not server_failures(server)


def test_http_level_garbage(server, models):
    """Framing errors are uvicorn's (400, plain text); paths and methods are the app's (JSON)."""
    for head in (b"GARBAGE\r\n\r\n", b"POST /v2/models/mlp/infer HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                 b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"):
        status, _, _ = raw(server, head)
        assert 400 <= status < 500
    # both framings at once (request smuggling): refused at once, not read either way
    expect_error(raw(server, http_request(INFER, b"5\r\nhello\r\n0\r\n\r\n",
                                          {"Content-Length": "5", "Transfer-Encoding": "chunked"})),
                 match="both Content-Length and Transfer-Encoding")
    status, _, _ = raw(server, http_request("/v2", b"", {"X-Big": "a" * 200_000}, method="GET"))
    assert 400 <= status < 500
    expect_error(server.request("GET", INFER), statuses=(405,))
    expect_error(server.request("PUT", INFER, b"{}"), statuses=(405,))
    for path in ("/v2/models/../../etc/passwd", "/v2/models/%00/infer", "/v2/models/mlp/versions/x/infer",
                 "/nope"):
        expect_error(server.request("POST", path, b"{}"), statuses=(404, 405))
    assert_healthy(server, models)
    assert not server_failures(server)


# -- clients that go away ------------------------------------------------------------------------------
def _failures_metric(server, reason) -> float:
    text = server.get("/metrics")[1].decode()
    for line in text.splitlines():
        if line.startswith(f'kiln_serve_request_failures_total{{model="mlp",reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_clients_that_disconnect(server, models):
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    body = mlp_json(x)
    before = _failures_metric(server, "disconnected")
    for k in range(count(ci=10, long=200)):
        # half a body, then close
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(http_request(INFER, body[:len(body) // 2], {"Content-Length": str(len(body))}))
        # headers only, then close
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(http_request(INFER, b"", {"Content-Length": str(len(body))}))
        # a whole request, closed before the response is read (a reset, not a FIN, every other time)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            if k % 2:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.sendall(http_request(INFER, body, {"Content-Length": str(len(body))}))
    deadline = time.monotonic() + 10
    while _failures_metric(server, "disconnected") - before < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _failures_metric(server, "disconnected") - before >= 1
    assert_healthy(server, models)
    assert not server_failures(server)


def test_a_body_that_never_finishes_gets_408(server, models):
    x = np.zeros((1, 16), np.float32)
    body = mlp_json(x)
    with socket.create_connection(("127.0.0.1", server.port), timeout=BODY_TIMEOUT + 10) as sock:
        t0 = time.monotonic()
        sock.sendall(http_request(INFER, body[:10], {"Content-Length": str(len(body))}))
        # meanwhile, the server answers others
        check_mlp_answer(models, x, post(server, body))
        status, headers, _ = resp = read_response(sock)
        expect_error(resp, statuses=(408,), match="did not arrive")
        assert headers.get("connection") == "close" and sock.recv(100) == b""    # closed
        assert time.monotonic() - t0 < BODY_TIMEOUT + 10
    assert_healthy(server, models)


# -- many clients at once ---------------------------------------------------------------------------------
def test_many_concurrent_clients_get_their_own_answers(server, models):
    threads_n, per_thread = 32, count(ci=6, long=50)
    results, errors = [], []

    def client(t):
        rng = np.random.default_rng(1000 + t)
        for k in range(per_thread):
            x = rng.standard_normal((1 + (t + k) % 4, 16)).astype(np.float32)
            try:
                if (t + k) % 2:
                    body, headers = mlp_binary(x)
                    resp = post(server, body, headers)
                else:
                    resp = post(server, mlp_json(x))
                results.append((x, resp))
            except Exception as e:  # noqa: BLE001 - counted, the test fails on any
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(t,)) for t in range(threads_n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.monotonic() - t0
    record("serve_concurrency", clients=threads_n, requests=len(results), errors=len(errors),
           seconds=round(took, 1))
    assert not errors, errors[:5]
    assert len(results) == threads_n * per_thread
    for x, resp in results:
        check_mlp_answer(models, x, resp)
    # tritonclient's own connection pool, async
    c = httpclient.InferenceServerClient(server.url, concurrency=32)
    rng = np.random.default_rng(7)
    jobs = []
    for k in range(count(ci=64, long=1000)):
        x = rng.standard_normal((1 + k % 3, 16)).astype(np.float32)
        inp = httpclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        jobs.append((x, c.async_infer("mlp", [inp])))
    for x, job in jobs:
        np.testing.assert_allclose(job.get_result(timeout=120).as_numpy("output0"), eager_mlp(models, x),
                                   atol=ATOL, rtol=RTOL)
    c.close()
    assert_healthy(server, models)


# -- soak: good and bad requests mixed, RSS bounded --------------------------------------------------
def _soak_request(server, models, rng, kind):
    """Send one request of ``kind``; returns None when the outcome is right, else what went wrong."""
    x = rng.standard_normal((1 + int(rng.integers(4)), 16)).astype(np.float32)
    try:
        if kind == "json":
            check_mlp_answer(models, x, post(server, mlp_json(x)))
        elif kind == "binary":
            body, headers = mlp_binary(x)
            check_mlp_answer(models, x, post(server, body, headers))
        elif kind == "gzip":
            check_mlp_answer(models, x, post(server, gzip.compress(mlp_json(x)), {"Content-Encoding": "gzip"}))
        elif kind == "bad_json":
            expect_error(post(server, mlp_json(x)[:-3]))
        elif kind == "bad_size":
            body, headers = mlp_binary(x, size=7)
            expect_error(post(server, body, headers))
        elif kind == "too_large":
            expect_error(post(server, b"[" + b"0," * (LIMIT // 2) + b"0]"), statuses=(413,))
        elif kind == "disconnect":
            body = mlp_json(x)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(http_request(INFER, body[:len(body) // 2], {"Content-Length": str(len(body))}))
        elif kind == "no_read":
            body = mlp_json(x)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(http_request(INFER, body, {"Content-Length": str(len(body))}))
        return None
    except (AssertionError, OSError, ValueError, http.client.HTTPException) as e:
        return f"{kind}: {type(e).__name__}: {str(e)[:200]}"


SOAK_MIX = ["json", "binary", "json", "binary", "gzip", "bad_json", "bad_size", "too_large",
            "disconnect", "no_read"]


def _soak(server, models, duration, threads_n=8):
    counts, problems = [0] * threads_n, []
    stop = time.monotonic() + duration

    def worker(t):
        rng = np.random.default_rng(5000 + t)
        k = 0
        while time.monotonic() < stop:
            problem = _soak_request(server, models, rng, SOAK_MIX[(t + k) % len(SOAK_MIX)])
            counts[t] += 1
            k += 1
            if problem:
                problems.append(problem)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 60)
    return sum(counts), problems


def test_soak_rss_stays_bounded(server, models):
    proc = psutil.Process(server.proc.pid)
    _soak(server, models, 2.0)                    # warm up: allocator pools, caches, threads
    rss_start = proc.memory_info().rss / 2**20
    duration = seconds(ci=10, long=60)
    t0 = time.monotonic()
    requests, problems = _soak(server, models, duration)
    took = time.monotonic() - t0
    time.sleep(0.5)
    rss_end = proc.memory_info().rss / 2**20
    growth = rss_end - rss_start
    record("serve_soak", requests=requests, errors=len(problems), seconds=round(took, 1),
           rss_start_mb=round(rss_start, 1), rss_end_mb=round(rss_end, 1), rss_growth_mb=round(growth, 1))
    print(f"serve soak: {requests} requests in {took:.1f} s, {len(problems)} errors, "
          f"RSS {rss_start:.1f} -> {rss_end:.1f} MB ({growth:+.1f} MB)")
    assert not problems, problems[:5]
    assert requests > 0
    assert growth < 50, f"server RSS grew {growth:.1f} MB over {requests} requests"
    assert_healthy(server, models)
    assert not server_failures(server)


def test_data_and_binary_together_and_values_past_the_datatype_get_400(server, models):
    """An input with both 'data' and binary_data_size was answered from the binary part, the
    'data' silently dropped; JSON 1e300 sent as FP32 (or 1e6 as FP16) silently became inf."""
    from kiln.errors import BadRequestError
    from kiln.serving.protocol import tensor_from_json
    x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
    data = x.tobytes()
    header = json.dumps({"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32",
                                     "data": x.reshape(-1).tolist(),
                                     "parameters": {"binary_data_size": len(data)}}]}).encode()
    expect_error(post(server, header + data, {"Inference-Header-Content-Length": str(len(header))}),
                 match="both 'data' and a binary_data_size")
    big = [1e300] + [0.0] * 15
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": big}]}).encode()
    expect_error(post(server, body), match="1e+300 does not fit FP32")
    with pytest.raises(BadRequestError, match="1e\\+06 does not fit FP16"):
        tensor_from_json([1e6, 1.0], torch.float16, [2], "x")
    torch.testing.assert_close(tensor_from_json([65504.0, -1.5], torch.float16, [2], "x"),
                               torch.tensor([65504.0, -1.5], dtype=torch.float16), rtol=0, atol=0)
    assert_healthy(server, models)
    assert not server_failures(server)


def test_an_empty_batch_is_answered_as_the_library_answers_it(server, models):
    """[0, 16] was refused with "expected shape [-1, 16] (-1: any size), got [0, 16]", which
    contradicts itself; the compiled model answers zero rows, and so does the server."""
    x = np.zeros((0, 16), np.float32)
    check_mlp_answer(models, x, post(server, mlp_json(x)))
    body, headers = mlp_binary(x)
    check_mlp_answer(models, x, post(server, body, headers))
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    ids = httpclient.InferInput("ids", [0, 6], "INT64")
    ids.set_data_from_numpy(np.zeros((0, 6), np.int64))
    mask = httpclient.InferInput("mask", [0, 6], "BOOL")
    mask.set_data_from_numpy(np.zeros((0, 6), bool))
    got = c.infer("emb", [ids, mask]).as_numpy("output0")
    assert got.shape == (0, 8)
    assert_healthy(server, models)
    assert not server_failures(server)


def test_model_config_is_in_tritons_format(server, models):
    """The config claims Triton's terms but gave each input as the metadata's shape, batch dim
    included, under 'shape', and "cores": [None] for unpinned instances. Triton's dims leave
    out the batch dim when max_batch_size > 0; kiln's own fields keep their own names."""
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = c.get_model_config("mlp")
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [16], "kiln_shape": [-1, 16]}]
    assert config["output"] == [{"name": "output0", "data_type": "TYPE_FP32", "dims": [4], "kiln_shape": [-1, 4]}]
    emb = c.get_model_config("emb")
    assert [(i["name"], i["data_type"], i["dims"]) for i in emb["input"]] == [
        ("ids", "TYPE_INT64", [6]), ("mask", "TYPE_BOOL", [6])]
    for group in config["instance_group"] + emb["instance_group"]:
        assert group["kind"] == "KIND_CPU" and group["count"] == 1
        assert "null" not in json.dumps(group) and "cores" not in group
