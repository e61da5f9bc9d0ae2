"""``kiln bench`` / ``kiln.bench`` (this module is kiln.benchmark): throughput and latency of kiln and its peers, NeuronPerf-style.

What it guards against is measuring the wrong thing: a cold compile cache,
one-off setup, a noisy neighbour process. So:

- Compiling happens before anything is timed (through the compile cache),
  and each runner warms up for ``warmup`` seconds before its window.
- Every model copy is its own process pinned to its own kiln core (copy i on
  core i mod N), as NeuronPerf runs one model per NeuronCore; ``workers``
  threads per copy call it back to back. All copies of a configuration run
  their windows at the same time.
- Peers (``compare``: eager, torchscript, torch.compile, onnxruntime,
  openvino) run the same model on the same inputs under the same pinning in
  the same run, so the table's ratios compare like with like. A peer that is
  not installed is skipped with a note. Peers need the model itself, so they
  need a factory target (``module:function``), not an artifact.
- kiln rows report the share of time spent in host fallback ops, so a
  fallback hiding in a fast-looking number is visible.

Targets: a ``.kiln`` artifact (a batch size other than the compiled one runs
through dynamic batch), a factory ``package.module:function`` returning
``(model, example_inputs)`` (compiled per batch size; the example's dim 0 is
resized), or a loaded kiln model.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

from kiln.benchmark import peers as peers_mod
from kiln.errors import KilnError

_MAX_SAMPLES = 20000   # latencies a copy sends back; beyond this, a uniform subsample


# -- parent ------------------------------------------------------------------------------------
def bench(target, *, path: str | None = None, batch_sizes=(1,), copies=None, workers=(1,),
          duration: float = 5.0, warmup: float = 1.0, compare=(), price_per_hour: float | None = None,
          json_path: str | None = None, plot_path: str | None = None, quiet: bool = False,
          compile_options: dict | None = None) -> dict:
    """Benchmark ``target`` (artifact path, ``module:factory`` or kiln model); returns the JSON report."""
    from kiln.host import cores as placement
    from kiln.observe.monitor import host_info
    n_cores = len(placement.visible())
    copies = list(copies or [n_cores])
    batch_sizes, workers = list(batch_sizes), list(workers)
    for label, values in (("batch_sizes", batch_sizes), ("copies", copies), ("workers", workers)):
        if not values or any(int(v) < 1 for v in values):
            raise KilnError(f"bench: {label} must be positive integers, got {values}")
    if duration <= 0 or warmup < 0:
        raise KilnError("bench: duration must be positive and warmup not negative")
    log = (lambda msg: None) if quiet else (lambda msg: print(f"kiln bench: {msg}", file=sys.stderr, flush=True))
    skipped, runners = [], ["kiln"]
    for name in compare:
        if name not in peers_mod.NAMES:
            raise KilnError(f"bench: unknown peer {name!r}; peers are {', '.join(peers_mod.NAMES)}")
        reason = peers_mod.unavailable(name)
        if reason is None and not _is_factory(target):
            reason = "peers run the model itself: give a factory (package.module:function), not an artifact"
        if reason:
            skipped.append({"runner": name, "reason": reason})
            log(f"skipping {name}: {reason}")
        elif name not in runners:
            runners.append(name)

    report = {"kiln_version": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "target": target if isinstance(target, str) else repr(target),
              "host": host_info(), "config": {"batch_sizes": batch_sizes, "copies": copies, "workers": workers,
                                              "duration_s": duration, "warmup_s": warmup,
                                              "price_per_hour": price_per_hour, "kiln_cores": n_cores,
                                              "compile_options": compile_options or {}},
              "baseline": "eager" if "eager" in runners else "kiln",
              "compile": [], "results": [], "skipped": skipped}
    cores = placement.visible()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for b in batch_sizes:
            artifact = _kiln_artifact(target, path, b, tmp, compile_options or {}, report, log)
            for runner in runners:
                for c in copies:
                    cfg = {"runner": runner, "artifact": artifact, "batch": b, "warmup": warmup,
                           "factory": target if _is_factory(target) else None, "path": path}
                    log(f"{runner}: batch {b}, {c} cop{'y' if c == 1 else 'ies'}: starting")
                    group = [_Copy(dict(cfg, cpus=list(cores[i % len(cores)].cpus), core=cores[i % len(cores)].id))
                             for i in range(c)]
                    try:
                        ready = [g.ready() for g in group]
                        failed = [r["error"] for r in ready if "error" in r]
                        if failed:
                            skipped.append({"runner": runner, "batch_size": b, "copies": c,
                                            "reason": failed[0]})
                            log(f"{runner} failed: {failed[0]}")
                            continue
                        for w in workers:
                            for g in group:
                                g.send({"workers": w, "duration": duration})
                            row = _aggregate(runner, b, c, w, [g.reply() for g in group], ready, price_per_hour)
                            if c > len(cores):
                                row["note"] = f"{c} copies on {len(cores)} kiln cores: oversubscribed"
                            report["results"].append(row)
                            log(f"{runner}: batch {b}, copies {c}, workers {w}: {row['throughput']:.1f} inf/s, "
                                f"p50 {row['latency_ms']['p50']:.2f} ms")
                    finally:
                        for g in group:
                            g.close()
    _ratios(report)
    if json_path:
        _write_json(json_path, report)
    if plot_path:
        plot(report, plot_path)
    return report


def _is_factory(target) -> bool:
    return isinstance(target, str) and ":" in target and not os.path.exists(target)


def _version() -> str:
    from kiln import __version__
    return __version__


def _kiln_artifact(target, path, batch, tmp, options, report, log) -> str:
    """The artifact kiln's copies load for this batch size (compiled through the cache if needed)."""
    from kiln.compiler import cache
    from kiln.runtime.model import Model
    if isinstance(target, Model):
        out = os.path.join(tmp, "model.kiln")
        if not os.path.exists(out):
            target.save(out)
        return out
    if not _is_factory(target):
        if not os.path.exists(target):
            raise KilnError(f"bench: {target} is neither an artifact file nor a module:factory")
        return os.path.abspath(target)
    import kiln
    from kiln.host import cores as placement
    model, args, kwargs = _factory_inputs(target, path, batch)
    before = dict(cache.stats)
    t0 = time.perf_counter()
    log(f"compiling for batch {batch} (compile time is not measured)")
    # Compile pinned to one kiln core with its thread count: that is how every copy runs, so
    # -O3 times its candidate engines under the conditions they will be measured in.
    core = placement.visible()[0]
    options = {"threads": len(core.cpus), **options}
    worker = placement.Worker(core.cpus, name="kiln-bench-compile")
    try:
        m = worker.call(lambda: kiln.trace(model, args, kwargs or None, quiet=True, **options) if args
                        else kiln.trace(model, kwargs, quiet=True, **options))
    finally:
        worker.close()
    seconds = time.perf_counter() - t0
    hit = cache.stats["hits"] + cache.stats["alias_hits"] > before["hits"] + before["alias_hits"]
    report["compile"].append({"batch_size": batch, "seconds": round(seconds, 3),
                              "cache": "hit" if hit else "compiled", "cache_key": m.cache_key,
                              "engines": sorted({p["engine"] for p in m.manifest.get("partitions", [])}),
                              "compiled_on": f"kiln core {core.id}, {options['threads']} thread(s)"})
    out = os.path.join(tmp, f"b{batch}.kiln")
    m.save(out)
    return out


def _factory_inputs(spec, path, batch):
    """(model, args, kwargs) from a factory, the example's dim 0 resized to ``batch``."""
    import torch
    from kiln.cli import load_factory
    model, example = load_factory(spec, path)
    args, kwargs = ((), example) if isinstance(example, dict) else \
        ((example,) if isinstance(example, torch.Tensor) else tuple(example), {})

    def resize(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == batch:
            return t
        reps = -(-batch // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].contiguous()
    return model.eval(), tuple(resize(a) for a in args), {k: resize(v) for k, v in kwargs.items()}


class _Copy:
    """One model copy: a fresh interpreter pinned to one kiln core, driven by JSON lines."""

    def __init__(self, cfg):
        env = {k: v for k, v in os.environ.items()
               if k not in ("KILN_PROFILE", "KILN_VISIBLE_CORES", "KILN_NUM_CORES")}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        env["KILN_QUIET"] = "1"
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", "from kiln.benchmark import _child; _child()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, env=env, cwd=os.getcwd())
        self.send(cfg)

    def send(self, msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            self.err.seek(0)
            tail = self.err.read()[-1500:].strip()
            raise KilnError(f"bench: a model copy exited (code {self.proc.returncode}) before replying"
                            + (f":\n{tail}" if tail else ""))
        return json.loads(line)

    def ready(self) -> dict:
        return self.reply()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send({"exit": True})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def _pct(sorted_values, q):
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def _aggregate(runner, batch, copies, workers, replies, ready, price) -> dict:
    calls = sum(r["calls"] for r in replies)
    elapsed = max(r["elapsed"] for r in replies)
    lat = sorted(x for r in replies for x in r["latencies_ms"])
    throughput = calls * batch / elapsed if elapsed > 0 else 0.0
    row = {"runner": runner, "batch_size": batch, "copies": copies, "workers": workers,
           "calls": calls, "inferences": calls * batch, "duration_s": round(elapsed, 3),
           "throughput": round(throughput, 3),
           "latency_ms": {"p50": _pct(lat, 50), "p90": _pct(lat, 90), "p99": _pct(lat, 99),
                          "max": max(r["max_ms"] for r in replies),
                          "mean": round(sum(r["sum_ms"] for r in replies) / calls, 4) if calls else None},
           "setup_s": round(max(r.get("setup_s", 0.0) for r in ready), 3),
           "cost_per_1m": round(price / 3600 / throughput * 1e6, 4) if price and throughput else None}
    shares = [r["host_share"] for r in replies if r.get("host_share") is not None]
    if shares:
        row["host_share"] = round(max(shares), 4)
    notes = sorted({r["note"] for r in ready if r.get("note")})
    if notes:
        row["note"] = "; ".join(notes)
    return row


def _ratios(report):
    base = report["baseline"]
    ref = {(r["batch_size"], r["copies"], r["workers"]): r for r in report["results"] if r["runner"] == base}
    for r in report["results"]:
        b = ref.get((r["batch_size"], r["copies"], r["workers"]))
        r[f"throughput_vs_{base}"] = round(r["throughput"] / b["throughput"], 3) \
            if b and b["throughput"] else None


def _write_json(path, report):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def table(report):
    """The report as a rich Table (p90 and the rest are in the JSON)."""
    from rich import box
    from rich.table import Table
    base = report["baseline"]
    t = Table(title=f"kiln bench: {report['target']}", header_style="bold", box=box.SIMPLE_HEAD)
    t.add_column("runner", no_wrap=True)
    for col in ("batch", "copies", "workers", "inf/s", "p50 ms", "p99 ms", "max ms", f"vs {base}"):
        t.add_column(col, justify="right")
    priced = report["config"]["price_per_hour"]
    if priced:
        t.add_column("$/1M inf", justify="right")
    for r in report["results"]:
        lat = r["latency_ms"]
        ratio = r.get(f"throughput_vs_{base}")
        cells = [_label(report, r["runner"]), str(r["batch_size"]), str(r["copies"]), str(r["workers"]), _fmt(r["throughput"]),
                 *(_fmt(lat[k]) for k in ("p50", "p99", "max")), f"{ratio:.2f}x" if ratio is not None else "-"]
        if priced:
            cells.append(f"{r['cost_per_1m']:.3g}" if r["cost_per_1m"] is not None else "-")
        t.add_row(*cells)
    return t


def notes(report) -> list[str]:
    """What the table cannot say: host fallback shares, dynamic batch, oversubscription, skipped peers."""
    out = []
    for r in report["results"]:
        said = []
        if r.get("host_share"):
            said.append(f"{100 * r['host_share']:.0f}% of its time on host fallback ops")
        if r.get("note"):
            said.append(r["note"])
        if said:
            out.append(f"{r['runner']} batch {r['batch_size']} copies {r['copies']} workers {r['workers']}: "
                       + "; ".join(said))
    out += [f"skipped {s['runner']}: {s['reason']}" for s in report["skipped"]]
    out += [f"kiln compile for batch {c['batch_size']}: {c['cache']} in {c['seconds']:.1f} s "
            f"({', '.join(c['engines']) or 'host'}), not measured" for c in report["compile"]]
    return out


def _label(report, runner) -> str:
    flags = report["config"].get("compile_options", {}).get("compiler_args")
    return f"kiln {flags}" if runner == "kiln" and flags else runner


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def plot(report, path):
    """Throughput vs p50 latency, one series per runner, one point per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for runner in dict.fromkeys(r["runner"] for r in report["results"]):
        rows = sorted((r for r in report["results"] if r["runner"] == runner), key=lambda r: r["latency_ms"]["p50"])
        xs = [r["latency_ms"]["p50"] for r in rows]
        ys = [r["throughput"] for r in rows]
        ax.plot(xs, ys, marker="o", label=_label(report, runner))
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(f"b{r['batch_size']} c{r['copies']} w{r['workers']}", (x, y), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    from matplotlib.ticker import FormatStrFormatter
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):   # plain numbers, not 10^x, on the log axes
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("latency p50 (ms)")
    ax.set_ylabel("throughput (inferences/s)")
    ax.set_title(f"kiln bench: {os.path.basename(str(report['target']))}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# -- copy process ------------------------------------------------------------------------------
def _child():
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # library chatter goes to stderr; stdout is the reply channel

    def reply(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    cfg = json.loads(sys.stdin.readline())
    os.sched_setaffinity(0, cfg["cpus"])
    threads = len(cfg["cpus"])
    import torch
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        run, model, note = _make_runner(cfg, threads)
        setup = time.perf_counter() - t0
        end, n = time.perf_counter() + cfg["warmup"], 0
        while n < 3 or time.perf_counter() < end:
            run()
            n += 1
    except Exception as e:  # noqa: BLE001 - reported to the parent, which skips this runner
        reply({"error": f"{type(e).__name__}: {e}"[:600]})
        return
    reply({"ready": True, "setup_s": setup, "note": note})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        before = _busy(model)
        res = _measure(run, int(cmd["workers"]), float(cmd["duration"]))
        if model is not None:
            after = _busy(model)
            busy = (after[0] - before[0]) + (after[1] - before[1])
            res["host_share"] = (after[1] - before[1]) / busy if busy > 0 else 0.0
        reply(res)


def _busy(model):
    if model is None:
        return (0.0, 0.0)
    from kiln.observe.metrics import metrics
    ids = {id_ for id_ in _metric_ids(model)}
    device = host = 0.0
    for s in metrics()["models"]:
        if s["id"] in ids:
            device, host = device + s["device_seconds"], host + s["host_seconds"]
    return device, host


def _metric_ids(model):
    m = getattr(model, "metrics", None)
    if m is not None:
        yield m.id
    else:
        for inner in getattr(model, "_inner_models", lambda: [])():
            yield from _metric_ids(inner)


def _make_runner(cfg, threads):
    """(zero-argument callable, kiln model or None, note) for this copy's runner."""
    batch = cfg["batch"]
    if cfg["runner"] == "kiln":
        import kiln
        if cfg["factory"]:   # first: the model's module may define ops its host fallback needs
            _, args, kwargs = _factory_inputs(cfg["factory"], cfg["path"], batch)
        model = kiln.load(cfg["artifact"], threads=threads)
        note = None
        lead = [s.shape[0] for s in model.input_specs if len(s.shape)]
        if lead and lead[0] != batch:
            model = kiln.dynamic_batch(model)
            note = f"compiled at batch {lead[0]}, run through dynamic batch"
        if not cfg["factory"]:
            args, kwargs = _inputs_from_specs(model.input_specs, batch, lead[0] if lead else None), {}
        return (lambda: model(*args, **kwargs)), model, note
    model, args, kwargs = _factory_inputs(cfg["factory"], cfg["path"], batch)
    return peers_mod.build(cfg["runner"], model, args, kwargs, threads), None, None


def _inputs_from_specs(specs, batch, compiled_batch):
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for s in specs:
        shape = list(s.shape)
        if shape and compiled_batch is not None and shape[0] == compiled_batch:
            shape[0] = batch
        if s.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(s.dtype))
        else:   # ids and masks: 1 is a valid token id and an "attend" mask value
            out.append(torch.ones(shape, dtype=s.dtype))
    return tuple(out)


def _measure(run, workers, duration) -> dict:
    samples = [[] for _ in range(workers)]
    ends = [0.0] * workers
    errors: list = []
    gate = threading.Barrier(workers + 1)
    state = {}

    def loop(i):
        mine = samples[i]
        gate.wait()
        deadline = state["deadline"]
        try:
            while True:
                t = time.perf_counter()
                if t >= deadline:
                    break
                run()
                mine.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    state["deadline"] = start + duration
    gate.wait()
    for t in threads:
        t.join()
    if errors:
        raise KilnError(f"bench: a call failed: {errors[0]}")
    lat = [x * 1e3 for s in samples for x in s]
    calls = len(lat)
    sent = lat if calls <= _MAX_SAMPLES else random.Random(0).sample(lat, _MAX_SAMPLES)
    return {"calls": calls, "elapsed": max(ends) - start, "latencies_ms": [round(x, 4) for x in sent],
            "max_ms": round(max(lat), 4) if lat else None, "sum_ms": sum(lat)}
