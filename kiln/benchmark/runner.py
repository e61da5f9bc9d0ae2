"""The ``kiln bench`` measurement: compile first, then run every configuration in pinned model-copy processes.

For each batch size, the kiln artifact is made (compiled through the cache,
outside any timing); then for each runner (kiln and the peers) and each copy
count, that many :class:`Copy` processes start, one per kiln core, warm up,
and measure each workers setting in windows that all copies run at once.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

from kiln.artifact.container import refuse_llm
from kiln.benchmark import peers
from kiln.benchmark.inputs import factory_inputs, is_factory
from kiln.benchmark.report import add_ratios, aggregate, check_output, plot, write_json
from kiln.errors import KilnError
from kiln.host import child


def bench(target, *, path: str | None = None, batch_sizes=(1,), copies=None, workers=(1,),
          duration: float = 5.0, warmup: float = 1.0, compare=(), price_per_hour: float | None = None,
          json_path: str | None = None, plot_path: str | None = None, quiet: bool = False,
          compile_options: dict | None = None) -> dict:
    """Benchmark ``target`` (artifact path, ``module:factory`` or kiln model); returns the JSON report."""
    from kiln.host import cores as placement
    from kiln.observe.monitor import host_info
    cores = placement.visible()
    copies = list(copies or [len(cores)])
    batch_sizes, workers = list(batch_sizes), list(workers)
    for label, values in (("batch_sizes", batch_sizes), ("copies", copies), ("workers", workers)):
        if not values or any(int(v) < 1 for v in values):
            raise KilnError(f"bench: {label} must be positive integers, got {values}")
    if not (math.isfinite(duration) and duration > 0 and math.isfinite(warmup) and warmup >= 0):
        # nan passed `duration <= 0` and measured forever
        raise KilnError("bench: duration must be a finite number above 0 and warmup finite, not below 0, "
                        f"got duration={duration}, warmup={warmup}")
    for out, what in ((json_path, "--json"), (plot_path, "--plot")):
        if out:
            check_output(out, what)   # before the run, not after it
    log = (lambda msg: None) if quiet else (lambda msg: print(f"kiln bench: {msg}", file=sys.stderr, flush=True))
    if isinstance(target, str) and not is_factory(target):
        refuse_llm(target, "kiln bench")
    runners, skipped = _runners(target, compare, log)
    report = {"kiln_version": _version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "target": target if isinstance(target, str) else repr(target),
              "host": host_info(), "config": {"batch_sizes": batch_sizes, "copies": copies, "workers": workers,
                                              "duration_s": duration, "warmup_s": warmup,
                                              "price_per_hour": price_per_hour, "kiln_cores": len(cores),
                                              "compile_options": compile_options or {}},
              "baseline": "eager" if "eager" in runners else "kiln",
              "compile": [], "results": [], "skipped": skipped}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for b in batch_sizes:
            artifact = _kiln_artifact(target, path, b, tmp, compile_options or {}, report, log)
            for runner in runners:
                for c in copies:
                    cfg = {"runner": runner, "artifact": artifact, "batch": b, "warmup": warmup,
                           "factory": target if is_factory(target) else None, "path": path}
                    _run_copies(report, cfg, c, workers, cores, duration, log)
    add_ratios(report)
    if json_path:
        write_json(json_path, report)
    if plot_path:
        plot(report, plot_path)
    return report


def _runners(target, compare, log):
    """(runners to measure, kiln first; peers skipped with their reason)."""
    skipped, runners = [], ["kiln"]
    for name in compare:
        if name not in peers.NAMES:
            raise KilnError(f"bench: unknown peer {name!r}; peers are {', '.join(peers.NAMES)}")
        reason = peers.unavailable(name)
        if reason is None and not is_factory(target):
            reason = "peers run the model itself: give a factory (package.module:function), not an artifact"
        if reason:
            skipped.append({"runner": name, "reason": reason})
            log(f"skipping {name}: {reason}")
        elif name not in runners:
            runners.append(name)
    return runners, skipped


def _run_copies(report, cfg, n_copies, workers, cores, duration, log):
    """Start ``n_copies`` copies of one runner, measure every workers setting, add a row for each."""
    runner, b, c = cfg["runner"], cfg["batch"], n_copies
    log(f"{runner}: batch {b}, {c} cop{'y' if c == 1 else 'ies'}: starting")
    group = [Copy(dict(cfg, cpus=list(cores[i % len(cores)].cpus), core=cores[i % len(cores)].id))
             for i in range(c)]
    try:
        ready = [g.ready() for g in group]
        failed = [r["error"] for r in ready if "error" in r]
        if failed:
            report["skipped"].append({"runner": runner, "batch_size": b, "copies": c, "reason": failed[0]})
            log(f"{runner} failed: {failed[0]}")
            return
        for w in workers:
            for g in group:
                g.send({"workers": w, "duration": duration})
            row = aggregate(runner, b, c, w, [g.reply() for g in group], ready,
                            report["config"]["price_per_hour"])
            if c > len(cores):
                row["note"] = f"{c} copies on {len(cores)} kiln cores: oversubscribed"
            report["results"].append(row)
            p50 = row["latency_ms"]["p50"]        # None when the window held no finished call
            log(f"{runner}: batch {b}, copies {c}, workers {w}: {row['throughput']:.1f} inf/s, "
                + (f"p50 {p50:.2f} ms" if p50 is not None else "no call finished within the window: "
                   "give a longer --duration"))
    finally:
        for g in group:
            g.close()


def _version() -> str:
    from kiln._version import __version__
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
    if not is_factory(target):
        if not os.path.exists(target):
            raise KilnError(f"bench: {target} is neither an artifact file nor a module:factory")
        return os.path.abspath(target)
    from kiln.compiler.api import trace
    from kiln.host import cores as placement
    from kiln.runtime.workers import Worker
    model, args, kwargs = factory_inputs(target, path, batch)
    before = dict(cache.stats)
    t0 = time.perf_counter()
    log(f"compiling for batch {batch} (compile time is not measured)")
    # Compile pinned to one kiln core with its thread count: that is how every copy runs, so
    # -O3 times its candidate engines under the conditions they will be measured in.
    core = placement.visible()[0]
    options = {"threads": len(core.cpus), **options}
    worker = Worker(core.cpus, name="kiln-bench-compile")
    try:
        m = worker.call(lambda: trace(model, args, kwargs or None, quiet=True, **options) if args
                        else trace(model, kwargs, quiet=True, **options))
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


class Copy:
    """One model copy: a fresh interpreter pinned to one kiln core (:mod:`kiln.benchmark.child`), driven by JSON lines."""

    def __init__(self, cfg):
        env = {k: v for k, v in os.environ.items()
               if k not in ("KILN_PROFILE", "KILN_VISIBLE_CORES", "KILN_NUM_CORES")}
        env = child.environment(env)
        env["KILN_QUIET"] = "1"
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(child.python("from kiln.benchmark.child import main; main()"),
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
