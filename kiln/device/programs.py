"""The programs a flush runs: one entry per trace key, holding its compiled graph, and
the compiles that fill them, in line or in the background.

A flush (:func:`flush`) chooses a trace's outputs (the values some live tensor still
holds) and runs it: through the compiled graph kept for its key, by interpreting it op
by op on CPU kernels, or by compiling it first (:func:`kiln.device.graphs.compile_graph`:
kiln's engines, the compile cache, the check against eager). When to compile is the
mode's choice (:class:`kiln.device.trace.Policy`): lazy mode compiles the first time a
program is seen, eager mode the second (one-off windows are not worth a compile). In the
background (the default outside a process group of several ranks) the program runs op by
op until its compile is ready, and a build due later (:func:`kiln.device.graphs.later_build`:
the whole graph, or Inductor where eager's kernels beat the first engine) is asked for
once the program has run often enough, then swapped in if it measured faster.
"""
from __future__ import annotations

import threading
import time

from kiln.device import metrics
from kiln.device import trace as tr
from kiln.device.trace import Policy, Trace


class _Entry:
    __slots__ = ("seen", "run", "name", "compiling", "failed", "interpreted", "later", "later_at",
                 "upgraded", "last_flush")

    def __init__(self, name):
        self.seen = 0
        self.run = None
        self.name = name
        self.compiling = None      # the background compile's thread while it runs
        self.failed = None         # why the background compile failed, until warned about
        self.interpreted = False   # run op by op at least once (a later compiled run is a swap)
        self.later = None          # (graph, inputs, options) of a build still due (graphs.later_build)
        self.later_at = 0          # ... once the program has been seen this many times
        self.upgraded = False      # that build is in, not yet run
        self.last_flush = 0        # the flush that ran it last (build_due)


_programs: dict = {}           # key -> _Entry
_programs_lock = threading.Lock()


def forget_programs():
    with _programs_lock:
        _programs.clear()
    tr.forget_templates()


class Overlapped:
    """What :func:`flush` returns instead of running a compiled program when asked to
    ``overlap`` it with the next step's recording (:mod:`kiln.device.inflight` runs it)."""

    def __init__(self, run, inputs, cells, name):
        self.run, self.inputs, self.cells, self.name = run, inputs, cells, name


def flush(trace: Trace, policy: Policy, at_step: bool = False, overlap: bool = False):
    """Run ``trace``; returns ``(cell, host tensor)`` for each live output. ``at_step``:
    the flush ends an optimizer step, so the program is a training step that will
    repeat and is compiled the first time it is seen. ``overlap``: a compiled program is
    not run but returned as :class:`Overlapped`, to run in the background."""
    live = trace.live_outputs()
    if not trace.ops:
        return []
    trace.settle_inputs()          # values a program in flight computes: waited for here
    outputs = [k for k, _ in live]
    key = trace.key(outputs)
    metrics.count("ReplayedOps", trace.replayed)
    metrics.count("RecordedOps", len(trace.ops) - trace.replayed)
    with _programs_lock:
        entry = _programs.get(key)
        if entry is None:
            entry = _programs[key] = _Entry(f"kiln device graph {len(_programs)}")
        entry.seen += 1
        _FLUSHES[0] += 1
        entry.last_flush = _FLUSHES[0]
    inputs = [data for _, data in trace.inputs]
    threshold = 1 if at_step else policy.compile_after
    if entry.run is None and entry.compiling is None and entry.seen >= threshold and outputs:
        if in_background(policy):
            _compile_in_background(entry, trace, outputs, inputs, policy)
        else:
            entry.run = _compile(trace, outputs, inputs, entry.name, policy)
    if entry.failed is not None:
        import warnings
        failed, entry.failed = entry.failed, None
        warnings.warn(f"kiln: {entry.name}: compiling it in the background failed ({failed}); "
                      "it runs op by op", RuntimeWarning, stacklevel=4)
    run = entry.run
    if run is not None and run is not _OP_BY_OP:
        if entry.interpreted:
            entry.interpreted = False
            metrics.count("SwappedIn")            # compiled in the background, now in use
        if entry.upgraded:
            entry.upgraded = False
            metrics.count("UpgradedIn")           # the whole-graph build, now in use
        if entry.later is not None and entry.compiling is None and entry.seen >= entry.later_at:
            _upgrade_in_background(entry)         # it runs again: worth its later build
        if overlap:
            return Overlapped(run, inputs, [cell for _, cell in live], entry.name)
        try:
            return [(cell, data) for (_, cell), data in zip(live, run(*inputs))]
        except Exception as e:      # noqa: BLE001 - run again op by op, below
            failure = e
        return [(cell, data) for (_, cell), data in zip(live, _op_by_op_after(entry, trace, outputs, failure))]
    started = time.perf_counter()
    results = trace.interpret(outputs)
    entry.interpreted = True
    metrics.count("InterpretedGraphs")
    metrics.sample("ExecuteTime", time.perf_counter() - started)
    return [(cell, data) for (_, cell), data in zip(live, results)]


def _op_by_op_after(entry, trace, outputs, failure):
    """A compiled program that raised, run again op by op on the same inputs (a program
    reads its inputs and writes only its outputs). Where eager PyTorch raises too (an index
    out of range), eager's error is the caller's, of the type and words the CPU gives (ONNX
    Runtime's Gather raises InvalidArgument where the CPU raises IndexError). Where eager
    runs, its results are returned, with a warning naming the program's failure
    (``CompiledRunFailed``): never a crash for a program kiln built. A program holding an
    operation other than ATen's (kiln's collectives across ranks) is not run again: this rank
    alone would repeat a collective the others ran once, and wait for ever; its failure is raised."""
    if any(getattr(op.func, "namespace", None) not in ("aten", "prims") for op in trace.ops):
        raise failure
    results = trace.interpret(outputs)          # eager's own error is raised here
    import warnings
    metrics.count("CompiledRunFailed")
    warnings.warn(f"kiln: {entry.name}: its compiled program failed ({type(failure).__name__}: {failure}); "
                  "this run went op by op", RuntimeWarning, stacklevel=4)
    return results


_OP_BY_OP = object()           # an entry's run after its compile failed: interpret it


def in_background(policy) -> bool:
    """Whether programs compile in the background. By default ("auto") they do, except in
    a ``torch.distributed`` process group of two or more ranks: there each rank would swap
    its compiled program in at a step of its own, and a step run compiled rounds otherwise
    than one run op by op, so replicas that must stay equal (DDP's parameters, tensor
    parallelism's replicated norms) would drift apart. In-line compiles switch every rank
    at the same step, as torch_xla's do."""
    if policy.background != "auto":
        return bool(policy.background)
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _compile_in_background(entry, trace, outputs, inputs, policy):
    """Compile in the compile process (:mod:`kiln.device.compile_process`; kiln's compile
    thread waits on it) while the program runs op by op (exactly CPU
    eager's kernels: the cheapest engine, and one that needs no check); the compiled
    program takes over at the first flush after it is ready (``SwappedIn``). It compiles
    and checks against copies of this flush's inputs: a later step may rebind or update
    the tensors these are. Its warnings go through the process's filters as they would
    from the caller; a compile that raises leaves the program running op by op, with a
    warning at its next flush."""
    from kiln.device.graphs import compile_graph, later_build
    gm = trace.graph(outputs)
    examples = [x.clone() for x in inputs]
    options = dict(policy.options)
    if options.get("whole_graph", True) is True:
        options["whole_graph"] = "later"          # partitions first, the whole graph when it repeats

    def work():
        try:
            entry.run = compile_graph(gm, examples, name=entry.name, real_inputs=True, in_child=True,
                                      **options)
            later = later_build(entry.run, options)
            if later is not None:
                entry.later, entry.later_at = (gm, examples, later[0]), entry.seen + later[1]
        except Exception as e:      # noqa: BLE001 - never a crash: the program still runs op by op
            entry.failed = f"{type(e).__name__}: {e}"
            entry.run = _OP_BY_OP
        finally:
            entry.compiling = None
    _submit(entry, work)


def _submit(entry, work):
    metrics.count("BackgroundCompile")
    entry.compiling = _compiler().submit(work)
    with _programs_lock:
        _COMPILING.append(entry.compiling)


def _upgrade_in_background(entry):
    """Build a program that runs in partitions (ONNX Runtime's, built in seconds, around
    operations it leaves on the host) whole on the engine ``whole_graph`` names (Inductor,
    whose C++ build takes tens of seconds to minutes), and swap it in when it is ready
    (``UpgradedIn``). Asked for only when the program runs again, so one-off programs
    are never built twice. A refused build leaves the partitions running, with a warning."""
    from kiln.device.graphs import faster, upgrade
    gm, examples, options = entry.later
    entry.later = None

    def work():
        try:
            better = upgrade(gm, examples, entry.name, options)
            if faster(better, entry.run):
                entry.run, entry.upgraded = better, True
        except Exception as e:      # noqa: BLE001 - the partitions keep running
            import warnings
            warnings.warn(f"kiln: {entry.name}: its whole-graph build failed ({type(e).__name__}: {e}); "
                          "its partitions keep running", RuntimeWarning, stacklevel=2)
        finally:
            entry.compiling = None
    _submit(entry, work)


def _compiler():
    """The one thread every device compile runs on, in turn: torch.export keeps state in
    globals (its module hierarchy, the dispatch-mode stack), so two exports at once on
    two threads break each other. A thread of its own also keeps the dispatcher state of
    a flush (inside ``__torch_dispatch__``, the Python key excluded) out of torch.export.
    Python waits for the work queued on it at exit; a background compile's wait ends
    first, as the compile process is killed (its cache writes are atomic)."""
    if not _WORKER:
        from concurrent.futures import ThreadPoolExecutor
        _WORKER.append(ThreadPoolExecutor(1, thread_name_prefix="kiln-device-compile"))
    return _WORKER[0]


_WORKER: list = []


def wait_compiles(timeout: float | None = None) -> bool:
    """Wait for the background compiles under way; True when none is left."""
    from concurrent.futures import wait
    with _programs_lock:
        pending = list(_COMPILING)
    wait(pending, timeout)
    with _programs_lock:
        _COMPILING[:] = [f for f in _COMPILING if not f.done()]
        return not _COMPILING


_COMPILING: list = []          # background compiles' futures (kept past forget_programs)
metrics.before_report(wait_compiles)      # a metrics report includes the compiles under way


def _compile(trace, outputs, inputs, name, policy):
    """Compile on the compile thread (:func:`_compiler`), waiting for it. Warnings are
    re-raised here, in the caller's thread."""
    import warnings

    from kiln.device.graphs import compile_graph
    gm = trace.graph(outputs)

    def work():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = compile_graph(gm, inputs, name=name, real_inputs=True, **policy.options)
        return run, caught
    run, caught = _compiler().submit(work).result()
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return run


def build_due() -> bool:
    """Whether a program flushed in the last few flushes has a build due once it runs again
    (:func:`kiln.device.graphs.later_build`): a caller waiting for a training loop's
    fastest steps (a benchmark) steps on until none is due and none compiling. Recent
    programs only: another (a first step's one-off program) may never run again."""
    with _programs_lock:
        return any(e.later is not None and _FLUSHES[0] - e.last_flush <= 4 for e in _programs.values())


_FLUSHES: list = [0]           # flushes so far
