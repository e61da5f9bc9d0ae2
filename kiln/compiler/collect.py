"""``kiln parallel-compile``: find every graph a script compiles, compile them all at once.

Neuron's ``neuron_parallel_compile`` job. A script that traces several models
compiles them one after another; on a machine with many cores most of that
time is wasted. This runs the script once in *collect mode*
(``KILN_COLLECT_DIR``): every ``kiln.trace`` that misses the cache captures
its graph, writes a job file (the captured graph, its example inputs and
outputs, options and cache key) and returns an eager stand-in so the script
carries on. Then the jobs compile in parallel worker processes, each storing
its result in the cache under the key the script will ask for. A normal run of
the script afterwards hits the cache for every graph.

Job files are written by this machine's own collect run and read back by its
workers: they are torch pickles, never shared or downloaded.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch

from kiln.atomic import write_atomic
from kiln.errors import CompilerArgsError
from kiln.compiler.caching import CacheHook, compile_into, reader
from kiln.compiler.driver import compile_graph
from kiln.compiler.options import CompileOptions
from kiln.graph.capture import Captured, FunctionModule, graph_module
from kiln.progress import Progress
from kiln import config
from kiln.host import child

log = logging.getLogger("kiln")


def collecting() -> str | None:
    """The job directory when this process is parallel-compile's collect run."""
    return config.get("KILN_COLLECT_DIR") or None


class EagerStandIn(torch.nn.Module):
    """What ``kiln.trace`` returns while collecting: the model, run eagerly."""

    def __init__(self, model, key):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            model = FunctionModule(model)
        self.model = model
        self.cache_key = key
        self.manifest = {"cache": {"key": key, "hit": False, "collected": True}}

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.model(*args, **kwargs)

    def save(self, *args, **kwargs):
        log.info("kiln parallel-compile: collecting; save() skipped")


def collect_hook(store, directory, progress):
    """The cache hook of a collect run: a hit is used as is; a miss writes a job file
    (the captured graph, its options and cache key) and returns an eager stand-in."""
    def on_miss(job, captured, key, fp):
        return record(directory, job, captured, key, fp, store.url)
    return CacheHook(store, retry_failed=False, progress=progress, on_miss=on_miss)


def collect_trace(model, example_inputs, example_kwargs, buckets, pad_values, pipeline_cores, trace_one):
    """``kiln.trace`` in a collect run: record every graph the trace would compile and hand
    back the model itself. Pipelines are not collected: their stage cut comes from
    timings taken at compile time, so they compile in the normal run."""
    from kiln.compiler.buckets import bucket_examples
    if pipeline_cores and pipeline_cores > 1:
        log.warning("kiln parallel-compile: pipelines are compiled in the normal run, not collected")
        return EagerStandIn(model, None)
    if buckets is not None:
        for n, (args, kwargs) in enumerate(bucket_examples(model, example_inputs, example_kwargs,
                                                           buckets, pad_values)):
            trace_one(model, args, kwargs, label=f"bucket {n + 1}")
        return EagerStandIn(model, None)
    return trace_one(model, example_inputs, example_kwargs)   # a cache hit is returned as is


def record(directory, job, captured, key, fp, url):
    """Write the job for ``key`` (once) and return an eager stand-in."""
    path = os.path.join(directory, f"{key}.job")
    if not os.path.exists(path):
        # The graph travels as a saved ExportedProgram (GraphModules do not pickle with
        # their node metadata); the rest as a torch pickle.
        exported = captured.exported
        if exported is None:        # an ATen graph traced without torch.export (kiln.graph.aten_graph)
            from kiln.graph.capture import capture
            exported = capture(job.model, job.args, job.kwargs, fast=False).exported
        write_atomic(os.path.join(directory, f"{key}.pt2"), lambda f: torch.export.save(exported, f))
        payload = {"key": key, "fingerprint": fp, "url": url, "compiler_args": job.compiler_args,
                   "options": job.options.to_dict(), "name": job.name, "threads": job.threads,
                   "captured": {k: getattr(captured, k) for k in CAPTURED_FIELDS},
                   "tensor_mask": captured.tensor_mask}
        write_atomic(path, lambda f: torch.save(payload, f))
        log.info("kiln parallel-compile: collected %s (%s)", captured.model_name, key[:16])
    return EagerStandIn(job.model, key)


CAPTURED_FIELDS = ("arg_names", "input_structure", "input_specs", "output_structure", "output_specs",
                   "example_inputs", "eager_outputs", "model_name", "notes", "draws", "positional")


def compile_job(path) -> dict:
    """Compile one job file into the cache (in a worker process), entering the compiler
    at the plan phase with the graph the collect run captured."""
    from kiln.compiler import cache as cache_mod
    payload = torch.load(path, weights_only=False)
    ep = torch.export.load(path[: -len(".job")] + ".pt2")
    captured = Captured(graph_module(ep, payload["tensor_mask"]), **payload["captured"])
    store = cache_mod.Cache(payload["url"])
    fields = dict(payload["options"], ops_on_host=frozenset(payload["options"]["ops_on_host"]))
    opts = CompileOptions(**fields)

    def compile_(cap):
        return compile_graph(cap.graph_module, None, None, opts, name=payload["name"],
                             threads=payload["threads"], progress=Progress(quiet=True), captured=cap)

    started = time.perf_counter()
    compiled = compile_into(store, payload["key"], payload["fingerprint"], captured, compile_,
                            payload["compiler_args"], reader(store, True, None))
    return {"model": captured.model_name, "key": payload["key"],
            "seconds": round(time.perf_counter() - started, 2),
            "hit": bool(compiled.manifest.get("cache", {}).get("hit"))}


def worker_main():
    """``python -c 'from kiln.compiler.collect import worker_main; worker_main()' JOB``:
    prints one JSON line."""
    try:
        result = {"ok": True, **compile_job(sys.argv[1])}
    except BaseException as e:  # noqa: B036 - reported to the driver
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print("KILN-RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


def parallel_compile(command, *, workers=None, cache_url=None, stream=None, quiet=None) -> dict:
    """Collect the graphs ``command`` compiles, then compile them in parallel."""
    from kiln.compiler import cache as cache_mod
    url = cache_mod.resolve_url(cache_url) or cache_mod.default_url()
    stream = stream or sys.stderr
    summary = {"cache": url, "jobs": [], "collect_returncode": None}
    with tempfile.TemporaryDirectory(prefix="kiln-collect-") as directory:
        env = dict(os.environ, KILN_COLLECT_DIR=directory, KILN_CACHE_URL=url)
        print(f"kiln parallel-compile: collecting graphs from: {' '.join(command)}", file=stream)
        try:
            collect = subprocess.run(command, env=env)
        except OSError as e:      # not found, not executable: a FileNotFoundError traceback until 12-03
            raise CompilerArgsError(f"cannot run {command[0]!r} ({e.strerror}): give the "
                                    "training command, e.g. kiln parallel-compile -- python train.py") from None
        summary["collect_returncode"] = collect.returncode
        if collect.returncode:
            print(f"kiln parallel-compile: the script exited with {collect.returncode} while "
                  "collecting; compiling what it traced before that", file=stream)
        jobs = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".job"))
        summary["jobs"] = _run_jobs(jobs, workers or _default_workers(len(jobs)), stream, quiet)
    done = sum(1 for j in summary["jobs"] if j["ok"])
    failed = len(summary["jobs"]) - done
    print(f"kiln parallel-compile: {len(summary['jobs'])} graph(s): {done} compiled into {url}, "
          f"{failed} failed", file=stream)
    for j in summary["jobs"]:
        if not j["ok"]:
            print(f"  failed: {j.get('error', '?')[:300]}", file=stream)
    return summary


def _default_workers(n_jobs) -> int:
    from kiln.host.cores import process_cpus
    return max(1, min(n_jobs, len(process_cpus())))


def _run_jobs(jobs, workers, stream, quiet) -> list:
    """Run job files in up to ``workers`` processes with a live 'remaining/done/failed' line."""
    progress = Progress("kiln parallel-compile", quiet=quiet, stream=stream)
    pending, running, results = list(jobs), {}, []
    started = time.perf_counter()
    env = dict(os.environ)
    env.pop("KILN_COLLECT_DIR", None)
    env = child.environment(env)
    last = None
    while pending or running:
        while pending and len(running) < workers:
            job = pending.pop(0)
            # output to files, not pipes: a chatty worker would fill a pipe read only at its exit
            with open(job + ".out", "w") as out, open(job + ".err", "w") as err:
                running[job] = subprocess.Popen(
                    child.python("from kiln.compiler.collect import worker_main; worker_main()", job),
                    env=env, stdout=out, stderr=err)
        for job, proc in list(running.items()):
            if proc.poll() is None:
                continue
            with open(job + ".out", errors="replace") as f_out, open(job + ".err", errors="replace") as f_err:
                out, err = f_out.read(), f_err.read()
            del running[job]
            line = next((ln for ln in out.splitlines() if ln.startswith("KILN-RESULT ")), None)
            result = json.loads(line[len("KILN-RESULT "):]) if line else {
                "ok": False, "error": f"worker exited with {proc.returncode}: {err.strip()[-500:]}"}
            results.append(result)
            if not progress.live:
                what = f"{result.get('model', '?')} in {result.get('seconds', '?')}s" if result["ok"] \
                    else result["error"][:200]
                print(f"kiln parallel-compile: {'done' if result['ok'] else 'FAILED'}: {what}", file=stream)
        done = sum(1 for r in results if r["ok"])
        elapsed = time.perf_counter() - started
        eta = (elapsed / len(results) * (len(jobs) - len(results))) if results else None
        text = (f"remaining {len(jobs) - len(results)}, done {done}, failed {len(results) - done} | "
                f"elapsed {elapsed:.0f}s" + (f" | ETA {eta:.0f}s" if eta is not None else ""))
        if progress.live and text != last:
            progress.write(f"kiln parallel-compile: {text}")
            last = text
        time.sleep(0.2)
    if progress.live:
        progress.write("")
    return results
