"""An LLM's graphs compiled side by side in worker processes.

An LLM is several graphs (a prefill per context bucket, a decode per batch size, a
verify graph), each a whole ``kiln.trace``: capture, ONNX export, quantization, engine
builds, checks against eager. Much of that is single-threaded Python (tracing, export,
the exporter's translation), so one graph after another leaves cores idle. Here each
graph compiles in its own process (spawned, not forked: torch's OpenMP pool and the
engines' thread pools do not survive a fork), and the parent loads what each one built.

What it gains, measured on 2 cores for SmolLM2-135M's three graphs (prefill 128, decode
at batch 1 and 8; one after another in this process / three workers): int4 108 / 86 s,
int8 114 / 89 s, float32 108 / 101 s (float32 builds and times two engines per graph);
after OpenVINO's conversion got cheaper (11-28), int4 59.5 / 49.9 s but float32 49.0 /
62.2 s, so float builds on fewer than 4 CPUs stay in this process (:func:`default_workers`).
Less than the cores promise: two workers slow each other's graphs by ~15 %, and a worker
spends ~9 s starting, loading the model and saving its graph.

What travels, all in a private temporary directory (mode 0700) that is removed after:

* the model, once, as a torch pickle written by this process and read back by its own
  workers (never a file from elsewhere);
* each compiled graph as a ``.kiln`` file, loaded with ``trust_native_code=True``: a
  graph this compile's own worker built may hold an Inductor library, which is trusted
  exactly as far as an in-process compile's is.

Engine choice by measurement is kept honest across workers by the measurement lock
(:func:`kiln.compiler.measure.time_runners` times one candidate set at a time on the
machine) and by the interleaved rounds it already takes, which spread background load
over every candidate alike.

Used when it pays (:func:`default_workers`): spawning a worker costs a few seconds of
imports, more than a tiny model's whole graph. For the same reason this process compiles
the first graph itself while the workers compile the others (``workers`` counts it): one
worker fewer to start, and one graph neither saved by a worker nor loaded back here.
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

from kiln import errors
from kiln.host.cores import process_cpus
from kiln.host import child

# Below this many parameters a graph compiles in a few seconds, less than a worker's start.
PARALLEL_MIN_PARAMETERS = 20_000_000
RESULT = "KILN-LLM-RESULT "
log = logging.getLogger("kiln")


def default_workers(model, n_jobs: int, quantized: bool = True) -> int:
    """Worker processes for ``n_jobs`` graphs: 1 (compile in this process) for small models,
    and for float (unquantized) builds on fewer than 4 CPUs; else one per graph, up to two
    per CPU and as many as the available memory holds.

    Two per CPU because a worker is not CPU-bound throughout (it waits on its files and on
    the measurement lock): SmolLM2-135M int4's three graphs on 2 cores took 108 s one after
    another, 97-102 s in two workers and 86 s in three. A float build's graphs carry their
    weights through files, ~650 MB a graph each way: on 2 cores SmolLM2 float32 took 49.0 s
    in this process against 62.2 s in three workers (int4 59.5 against 49.9 s; 11-28, after
    OpenVINO's conversion was made cheaper). Memory: a worker peaked at 3.2-4.2 GB for that
    model's 540 MB of float32 weights, so each is budgeted :func:`worker_bytes`."""
    if n_jobs < 2 or len(process_cpus()) < 2:
        return 1
    if sum(p.numel() for p in model.parameters()) < PARALLEL_MIN_PARAMETERS:
        return 1
    if not quantized and len(process_cpus()) < 4:
        return 1
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    by_memory = int(0.75 * _available_bytes() // worker_bytes(weight_bytes))
    return max(1, min(n_jobs, 2 * len(process_cpus()), by_memory))


def worker_bytes(weight_bytes: int) -> int:
    """Memory budgeted per worker: six copies of the weights (the model, its captured graph,
    the engine's model and session, the check against eager) and 1 GiB of runtime."""
    return 6 * weight_bytes + (1 << 30)


def _available_bytes() -> int:
    import psutil
    return psutil.virtual_memory().available


def compile_graphs(model, jobs, trace_options, workers: int, on_graph=None) -> list:
    """Compile ``jobs`` (``(name, step_kwargs, example)``: a :class:`DecoderStep` of
    ``model`` built with ``step_kwargs``, traced at ``example`` with ``trace_options``, one
    dict for every job or a list of one per job) in up to ``workers`` processes; the compiled graphs in the order of ``jobs``. A worker's failure is raised
    here with its message, as the in-process compile would have raised it. None when the
    model cannot be pickled for the workers (the caller compiles in its own process)."""
    from kiln.runtime.loader import load
    per_job = trace_options if isinstance(trace_options, list) else [trace_options] * len(jobs)
    with tempfile.TemporaryDirectory(prefix="kiln-llm-") as tmp:
        try:
            torch.save({"model": model, "options": per_job,
                        "jobs": [(name, kwargs, example) for name, kwargs, example in jobs]},
                       os.path.join(tmp, "jobs.pt"))
        except Exception as e:  # noqa: BLE001 - a model that does not pickle (hooks, closures)
            log.warning("kiln llm: compiling the graphs one after another in this process: the model "
                        "cannot be sent to worker processes (%s: %s)", type(e).__name__, e)
            return None
        names = [name for name, _, _ in jobs]
        runner = _Workers(tmp, names, on_graph)
        try:
            runner.start(range(1, len(jobs)), workers - 1)
            here = _compile_here(model, jobs[0], per_job[0])
            runner.finished(names[0], here[1])
            runner.run(workers)
        finally:
            runner.stop()
        started = time.perf_counter()
        graphs = [here[0]] + [load(os.path.join(tmp, f"{k}.kiln"), trust_native_code=True)
                              for k in range(1, len(jobs))]
        log.info("kiln llm: loaded %d graphs from the workers in %.1fs", len(graphs) - 1,
                 time.perf_counter() - started)
        return graphs


def _compile_here(model, job, trace_options) -> tuple:
    """``(graph, seconds)``: ``job`` compiled in this process; its error is raised as a
    worker's would be, naming the graph."""
    from kiln.compiler.api import trace
    from kiln.llm.decoder import DecoderStep
    name, step_kwargs, example = job
    started = time.perf_counter()
    try:
        graph = trace(DecoderStep(model, **step_kwargs).eval(), example, **trace_options)
    except errors.KilnError as e:
        raise type(e)(f"{name} graph: {e}") from e
    return graph, time.perf_counter() - started


class _Workers:
    """The worker processes of one compile: started per job, waited for, reported."""

    def __init__(self, tmp, names, on_graph):
        self.tmp, self.names, self.on_graph = tmp, names, on_graph
        self.env = child.environment()
        self.pending, self.running, self.done = [], {}, 0

    def start(self, jobs, at_most: int) -> None:
        """Queue ``jobs`` and start up to ``at_most`` workers at once."""
        self.pending += list(jobs)
        self._fill(at_most)

    def _fill(self, at_most):
        while self.pending and len(self.running) < at_most:
            k = self.pending.pop(0)
            # output to files, not pipes: a worker's warnings could fill a pipe nobody
            # reads until it exits, and it would never exit
            with open(os.path.join(self.tmp, f"{k}.out"), "w") as out, \
                    open(os.path.join(self.tmp, f"{k}.err"), "w") as err:
                self.running[k] = (time.perf_counter(), subprocess.Popen(
                    child.python("from kiln.llm.parallel import worker_main; worker_main()", self.tmp, k),
                    env=self.env, stdout=out, stderr=err))

    def finished(self, name, seconds) -> None:
        self.done += 1
        if self.on_graph is not None:
            self.on_graph(name, self.done, len(self.names), seconds)

    def run(self, workers: int) -> None:
        """Until every queued job is done, up to ``workers`` at once; a failure is raised."""
        while self.pending or self.running:
            self._fill(workers)
            for k, (started, proc) in list(self.running.items()):
                if proc.poll() is None:
                    continue
                del self.running[k]
                seconds = _check(_read(self.tmp, f"{k}.out"), _read(self.tmp, f"{k}.err"), proc.returncode,
                                 self.names[k])
                log.info("kiln llm: %s graph compiled in a worker: %s", self.names[k],
                         ", ".join(f"{what} {s:.1f}" for what, s in seconds.items()))
                self.finished(self.names[k], time.perf_counter() - started)
            time.sleep(0.1)

    def stop(self) -> None:
        for _, proc in self.running.values():       # an error or ^C: no orphaned compiles
            proc.kill()
            proc.wait()


def _read(tmp, name) -> str:
    with open(os.path.join(tmp, name), errors="replace") as f:
        return f.read()


def _check(out, err, returncode, name) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith(RESULT)), None)
    if line is None:
        raise errors.CompileError(f"compiling the LLM's {name} graph: its worker process exited with "
                                  f"{returncode}: {err.strip()[-1500:] or 'no output'}")
    result = json.loads(line[len(RESULT):])
    if not result["ok"]:
        kind = getattr(errors, result["type"], None)
        if not (isinstance(kind, type) and issubclass(kind, errors.KilnError)):
            kind = errors.CompileError
        raise kind(f"{name} graph: {result['message']}")
    return {**result["seconds"], "peak MB": result["peak_mb"]}


def worker_main():
    """``python -c '...worker_main()' DIR K``: compile job K of DIR/jobs.pt into DIR/K.kiln
    and print one result line."""
    from kiln.compiler.api import trace
    from kiln.engines import onnx_model
    from kiln.llm.decoder import DecoderStep
    tmp, k = sys.argv[1], int(sys.argv[2])
    marks = [time.perf_counter()]
    try:
        payload = torch.load(os.path.join(tmp, "jobs.pt"), weights_only=False, mmap=True)   # our own file
        _, step_kwargs, example = payload["jobs"][k]
        step = DecoderStep(payload["model"], **step_kwargs).eval()
        marks.append(time.perf_counter())
        options = payload["options"]
        with onnx_model.decoder_graphs():
            compiled = trace(step, example, **(options[k] if isinstance(options, list) else options))
        marks.append(time.perf_counter())
        compiled.save(os.path.join(tmp, f"{k}.kiln"))
        marks.append(time.perf_counter())
        import resource
        result = {"ok": True, "seconds": {"load": marks[1] - marks[0], "trace": marks[2] - marks[1],
                                          "save": marks[3] - marks[2]},
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        result = {"ok": False, "type": type(e).__name__, "message": str(e)}
    print(RESULT + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)
