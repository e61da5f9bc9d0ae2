"""Part (a), through the server: 8 concurrent completions against ``kiln serve`` of a tp 1 and
a tp 2 artifact (one at a time, the same 2 cores), aggregate generated tokens per second.

``python -m benchmarks.dist_parts.serve8 TP1.kiln TP2.kiln`` (the artifacts
``benchmarks/distributed.py --parts a --reuse`` leaves in ``~/.cache/kiln/dist-bench``);
prints a table and writes ``benchmarks/results/dist-serve8.json``.
"""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time

STREAMS, TOKENS = 8, 64
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "Who wrote Hamlet?", "Give me a tip for learning Python.",
           "What is 12 times 7?", "Describe a cat in one sentence."]


def _post(port, prompt):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out["usage"]["completion_tokens"]


def _serve(path, port, log):
    exe = os.path.join(os.path.dirname(sys.executable), "kiln")
    proc = subprocess.Popen([exe, "serve", f"m={path}", "--port", str(port), "--trust-native-code"],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"{path}: the server did not become ready")


def measure(path, port) -> dict:
    with open(os.devnull, "w") as log:
        proc = _serve(path, port, log)
        try:
            _post(port, PROMPTS[0])                                   # warm
            counts, threads = [0] * STREAMS, []
            t0 = time.perf_counter()
            for i in range(STREAMS):
                threads.append(threading.Thread(target=lambda i=i: counts.__setitem__(i, _post(port, PROMPTS[i]))))
                threads[-1].start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(60)
    return {"artifact": os.path.basename(path), "streams": STREAMS, "tokens": sum(counts),
            "seconds": round(seconds, 3), "tok_s": round(sum(counts) / seconds, 1)}


def main(argv=None):
    paths = (argv or sys.argv[1:]) or [os.path.expanduser(f"~/.cache/kiln/dist-bench/smollm2-tp{t}.kiln")
                                       for t in (1, 2)]
    rows = [measure(p, 8390 + k) for k, p in enumerate(paths)]
    print(f"{'artifact':<24} {'streams':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for r in rows:
        print(f"{r['artifact']:<24} {r['streams']:>7} {r['tokens']:>7} {r['seconds']:>8} {r['tok_s']:>7}")
    if len(rows) == 2:
        print(f"tp 2 / tp 1: {rows[1]['tok_s'] / rows[0]['tok_s']:.2f}x")
    out = os.path.join(os.path.dirname(__file__), "..", "results", "dist-serve8.json")
    with open(out, "w") as f:
        json.dump({"rows": rows, "loadavg": os.getloadavg()}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
