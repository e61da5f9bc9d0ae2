"""One FX graph PyTorch hands over at run time, through kiln's compiler.

``torch.compile``'s AOTAutograd (and, later, a lazy device's ``mark_step``) gives kiln
a graph of ATen operations over flat tensors. kiln compiles ahead of time against real
values (it checks the compiled graph against eager PyTorch), and AOTAutograd's example
inputs are *fake* (shapes and dtypes, no data): such a graph is compiled on its first
call, against that call's values. Invented values do not do: a backward graph's inputs
are what its forward saved (a layer norm's mean and 1/std, attention's log-sum-exp, its
output), which hold together only as a forward computed them. Random normal ones (a
negative 1/std, a log-sum-exp below the largest score, so "probabilities" up to e^9)
took a small transformer's gradients to 3.6e8 (0.02 on its real values), where any two
correct fp32 summation orders differ by hundreds: its backward graph failed the check
on an AVX-512 CPU (5.9 % at one element) and passed with PyTorch's kernels held to
AVX2, by luck either way; on its real values the two agree to 2e-7 of its largest
gradient. A device's flush hands over real values (``real_inputs``), compiled against
at once.
Parameters and buffers are graph *inputs* in these graphs, never constants, so a
training step's new weights flow in on every call.

Graphs are compiled ``whole_graph``: when the first engine would leave operations on
the host that split the graph (a bf16 ``native_dropout`` on ONNX Runtime; a float32 one's
mask is drawn apart, :mod:`kiln.graph.dropout`), an engine that takes every operation
(Inductor) compiles the whole graph instead.

A graph kiln cannot compile (an operation no engine and no host kernel takes, a check
against eager that fails, symbolic shapes) runs eagerly as PyTorch traced it, with a
warning that names why: never a crash, never a silently wrong answer. A graph that eager
PyTorch itself fails to run on the values it was to be compiled against (an index out of
range, a class beyond ``num_classes``) is not such a graph: the values are at fault, the
caller gets eager's error, and the graph compiles at a later run with good values
(:class:`InputsFail`). It was pinned to eager for the rest of the process, with a warning
blaming the compile, after one bad batch.
"""
from __future__ import annotations

import builtins
import hashlib
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from kiln.compiler.api import trace
from kiln.device import metrics, output_aliases
from kiln.errors import KilnError
from kiln.graph import randomness, tracing_lock
from kiln.runtime import value_checks


class InputsFail(Exception):
    """The graph raises in eager PyTorch on the values it was to be compiled against:
    nothing is decided about compiling it (module doc)."""


def _fails_on(gm, examples) -> bool:
    """Whether eager PyTorch raises running ``gm`` on ``examples`` (asked only after a
    compile failed). Its run draws nothing of the caller's: the generators are set back,
    so the call then run eagerly draws eager's numbers (a training graph with dropout that
    failed to compile drew its masks twice, and its first call answered other masks than
    eager's, every later draw shifted)."""
    try:
        with unset_fake_temporarily(), randomness.unchanged():
            gm(*examples)
    except Exception:       # noqa: BLE001 - any error of eager's own is the values'
        return True
    return False


def structure_of(gm: torch.fx.GraphModule) -> str:
    """A digest of the graph's operations and wiring, not its shapes: the same graph
    compiled for another shape has the same structure."""
    text = []
    for node in gm.graph.nodes:
        text.append(f"{node.op}:{node.target}:{[str(a) for a in node.args]}")
    return hashlib.sha256("\n".join(text).encode()).hexdigest()[:16]


def _readers(gm) -> list:
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            users = [u for u in node.users if u.op == "call_function"]
            out.append(str(users[0].target) if users else "unused")
    return out


def _symbolic(inputs) -> bool:
    """Whether a graph's inputs have symbolic sizes, or are symbolic numbers themselves (an
    int argument Dynamo made dynamic: ``f(x, n)`` called with a second ``n``)."""
    return any((isinstance(x, torch.Tensor) and not all(isinstance(d, int) for d in x.shape))
               or isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in inputs)


def _fake(args) -> bool:
    return any(isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.is_meta) for x in args)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, *, name: str, real_inputs=False, in_child=False,
                  **options):
    """A callable ``f(*tensors) -> list of tensors``: ``gm`` compiled by kiln, or ``gm``
    itself (eager) with a warning when it cannot be. ``real_inputs``: the examples are
    real data (a device's flush), compiled and checked against now; else (fake tensors,
    torch.compile's) ``gm`` compiles on its first call, against that call's values. Its
    ``compiled`` is the compiled model, None while it runs eagerly or is not compiled yet."""
    inputs = list(example_inputs)
    _without_empty_cats(gm)
    # a training graph split around host operations runs slower than one compiled whole
    options.setdefault("whole_graph", True)
    ops = sum(n.op == "call_function" for n in gm.graph.nodes)
    metrics.sample("TensorsGraphSize", ops)
    if _symbolic(inputs):
        if real_inputs:
            return _eager(gm, name, "its shapes are symbolic (dynamic); kiln compiles static shapes")
        return _per_shape(gm, name, options, inputs)
    shapes = [tuple(int(d) for d in x.shape) if isinstance(x, torch.Tensor) else None for x in inputs]
    metrics.note_compile(structure_of(gm), shapes, _readers(gm), f"graph '{name}' ({ops} ops)")
    if real_inputs:
        try:
            return (build_in_child if in_child else _build)(gm, tuple(inputs), name, options)
        except InputsFail:
            return None         # not compiled: the caller runs it op by op (eager's error) and asks again
    return _on_first_call(gm, name, options)


def _without_empty_cats(gm) -> int:
    """Each ``cat`` of one tensor and empty ones becomes a contiguous copy of that tensor
    (what ``cat`` returns), where its metadata says contiguous; returns how many did.
    Inductor's decomposition of such a ``cat`` clones the tensor in its own layout, and a
    view traced against ``cat``'s contiguous output is then refused: a Hugging Face
    attention's key, concatenated to an empty cache, transposed and expanded for a batched
    matmul, stopped a tiny GPT-2 under bf16 autocast ("Cannot view a tensor with shape
    [2, 2, 16, 7] and strides (224, 16, 1, 32)"), and plain Inductor fails on that code too."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        out = node.meta.get("val")
        kept = [t for t in node.args[0] if not _empty(t)]
        if len(kept) != 1 or len(kept) == len(node.args[0]) or not isinstance(out, torch.Tensor) \
                or not isinstance(kept[0], torch.fx.Node) or not isinstance(kept[0].meta.get("val"), torch.Tensor):
            continue
        val = kept[0].meta["val"]
        if val.dtype != out.dtype or tuple(val.shape) != tuple(out.shape) or not out.is_contiguous():
            continue
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (kept[0],),
                                          {"memory_format": torch.contiguous_format})
        copy.meta.update(node.meta)
        node.replace_all_uses_with(copy)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done


def _empty(arg) -> bool:
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and isinstance(val.numel(), int) and val.numel() == 0


def _per_shape(gm, name, options, inputs):
    """torch.compile's graph with symbolic shapes (Dynamo's automatic dynamic shapes), compiled
    for each concrete shape it is called with (:mod:`kiln.device.per_shape`)."""
    from kiln.device.per_shape import compiled_per_shape
    eager = _eager(gm, name, None)

    def static(graph, label):
        examples = [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"]
        return compile_graph(graph, examples, name=label, **options)
    per_shape = compiled_per_shape(gm, name, static, eager, inputs)

    def run(*args):
        return eager(*args) if _fake(args) else per_shape(*args)
    run.compiled, run.shapes = None, per_shape.shapes
    return run


def _on_first_call(gm, name, options):
    """``gm``'s callable that compiles it on the first call with real values, checked
    against eager on them (once, under a lock). A call under a fake mode (a tracer's)
    runs ``gm`` as traced and compiles nothing. The compile runs on a thread of its own:
    the call comes from inside PyTorch's runtime (AOTAutograd runs a forward under a
    dispatch mode of its own, autocast excluded, grad off), whose thread-local state
    ``torch.export`` must not inherit (under it, capture failed: "Attempting to use
    FunctionalTensor on its own")."""
    lock, built = threading.Lock(), []

    def run(*args):
        if not built:
            if _fake(args):
                return _listed(gm(*args))
            with lock:
                if not built:
                    examples = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                    try:
                        first = _on_compile_thread(_build, gm, examples, name, options)
                    except InputsFail:          # eager's own error on these values, raised here
                        return _listed(gm(*args))
                    built.append(_on_compile_thread(_inductor_too, gm, examples, name, options, first))
                    run.compiled = built[0].compiled
        return built[0](*args)
    run.compiled = None
    return run


def _on_compile_thread(fn, *args):
    """``fn(*args)`` on a thread of its own (:func:`_on_first_call`), or on this one where it
    holds kiln's tracing lock: a graph first called inside a compile this thread runs (a
    compiled model whose checks run a model holding a ``torch.compile(backend="kiln")``
    part) would wait forever for a compile thread waiting for this thread's lock."""
    if tracing_lock.mine():
        return fn(*args)
    with ThreadPoolExecutor(1, thread_name_prefix="kiln-compile") as pool:
        return pool.submit(fn, *args).result()


def _listed(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _inductor_too(gm, examples, name, options, first):
    """A graph compiled on its first call (``torch.compile``'s) for which :func:`later_build`
    names a build (the whole graph on Inductor: -O2 kept it on eager's kernels, or its run
    took 5 ms or more) gets it at once, kept only if it measured faster: its compile happens
    in-line anyway, and it has no later run to wait for. The benchmark's CNN had its forward
    on ONNX Runtime (9.6 ms; Inductor 4.2) and its backward on eager's kernels (24.9 ms;
    Inductor 8.5), leaving ``torch.compile(backend="kiln")`` at 0.56x Inductor's speed (11-29)."""
    later = later_build(first, options)
    # runs == 0 is the whole-graph-later case, which needs whole_graph="later": not in-line
    if later is None or not later[1]:
        return first
    started = time.perf_counter()
    with unset_fake_temporarily():
        try:
            compiled = trace(gm, examples, name=name, quiet=True, **later[0])
        except Exception:            # noqa: BLE001 - eager's kernels keep the graph, as -O2 chose
            metrics.count("UpgradeRefused")
            return first
    second = _runner(gm, compiled, started, bool(compiled.manifest.get("cache", {}).get("hit")))
    if not faster(second, first):
        return first
    metrics.count("UpgradedIn")
    return second


def _build(gm, examples, name, options):
    """``gm`` compiled with the real ``examples`` (a callable like :func:`compile_graph`'s),
    or run eagerly with a warning naming why it could not be."""
    started = time.perf_counter()
    # a caller may be tracing under a fake mode: kiln compiles and checks with real tensors
    with unset_fake_temporarily():
        try:
            compiled = trace(gm, examples, name=name, quiet=True, **options)
            misfit = _misfit(compiled, gm) if compiled.manifest.get("cache", {}).get("hit") else None
            if misfit:                 # never run another graph's artifact: compile afresh
                _warn_misfit(name, misfit)
                compiled = trace(gm, examples, name=name, quiet=True, **{**options, "cache": False})
        except KilnError as e:
            return _eager_unless_inputs_fail(gm, examples, name, str(e))
        except Exception as e:       # torch itself failing on the graph: still never a crash
            return _eager_unless_inputs_fail(gm, examples, name, f"{type(e).__name__}: {e}")
    return _runner(gm, compiled, started, bool(compiled.manifest.get("cache", {}).get("hit")))


def _eager_unless_inputs_fail(gm, examples, name, why, refused=None):
    """``refused(why)`` (default: run ``gm`` eagerly with a warning), or :class:`InputsFail`
    where eager PyTorch fails on ``examples`` too."""
    if _fails_on(gm, examples):
        raise InputsFail(why)
    return (refused or (lambda reason: _eager(gm, name, reason)))(why)


def build_in_child(gm, examples, name, options, refused=None):
    """:func:`_build`, the compile done by the compile process
    (:mod:`kiln.device.compile_process`): the training process only loads the result.
    Its warnings are raised here; its refusals run ``gm`` eagerly with the reason, or
    return ``refused(reason)`` where one is given (an upgrade, :func:`upgrade`)."""
    refused = refused or (lambda why: _eager(gm, name, why))
    from kiln.device import compile_process
    from kiln.runtime.loader import load
    started = time.perf_counter()
    child = compile_process.shared()
    try:
        answer = child.compile(gm, examples, name, options)
        compiled = load(answer["path"], trust_native_code=True) if "path" in answer else None
        misfit = _misfit(compiled, gm) if compiled is not None and answer["hit"] else None
        if misfit:
            _warn_misfit(name, misfit)
            answer = child.compile(gm, examples, name, {**options, "cache": False})
            compiled = load(answer["path"], trust_native_code=True) if "path" in answer else None
    except compile_process.Unpicklable:         # a graph holding something pickle cannot take
        return _build(gm, examples, name, options)
    except compile_process.Closed:              # the process is exiting: no failure to report
        return _eager(gm, name, None)
    except (compile_process.ChildError, KilnError) as e:
        return _eager_unless_inputs_fail(gm, examples, name, str(e), refused)
    for category, message in answer["warnings"]:
        category = getattr(builtins, category, None)
        warnings.warn(message, category if isinstance(category, type) and issubclass(category, Warning)
                      else UserWarning, stacklevel=2)
    if compiled is None:
        return _eager_unless_inputs_fail(gm, examples, name, answer["error"], refused)
    return _runner(gm, compiled, started, answer["hit"])


def whole_graph_later(run) -> bool:
    """Whether ``run`` (a compiled program, :func:`compile_graph`'s) was built in partitions
    with ``whole_graph="later"`` where the whole graph would go to one engine: the build
    :func:`upgrade` makes."""
    compiled = getattr(run, "compiled", None)
    return compiled is not None and bool(compiled.manifest.get("whole_graph_later"))


# runs of a program before its Inductor build is asked for: a program that repeats this
# often is a training loop worth a build of tens of seconds, and the tests' few steps of
# tiny models never ask for one
LOST_TO_EAGER_RUNS = 8
# a graph whose run measured at least this (ms) on the engine -O2 kept is worth timing on
# Inductor too; below it, a C++ build of tens of seconds buys little (the tests' tiny models)
INDUCTOR_WORTH_MS = 5.0


def later_build(run, options) -> tuple | None:
    """``(options, runs)`` of a build due once the program compiled as ``run`` has run
    ``runs`` more times, or None. Two cases. The program runs in partitions where the whole
    graph would go to one engine (:func:`whole_graph_later`): the whole graph, at once. Or
    -O2 timed it and it is not on Inductor, and either every engine tried ran slower than
    eager's own kernels (so -O2 kept it on them: a CNN step's convolution gradients on ONNX
    Runtime, 61 ms against eager's 35) or its run measured at least
    :data:`INDUCTOR_WORTH_MS` (the same CNN's forward on ONNX Runtime, 7.5 ms against
    Inductor's fused convolutions): then the whole graph on Inductor, held to eager's speed
    at -O2 like any build and taken only if it measured faster (:func:`faster`)."""
    compiled = getattr(run, "compiled", None)
    manifest = compiled.manifest if compiled is not None else {}
    timed_ms = (manifest.get("speed_vs_eager") or {}).get("latency_ms")
    if whole_graph_later(run):
        # already whole on one engine (a bf16 step on OpenVINO): Inductor only where it may pay
        if _one_engine(manifest) and (timed_ms is None or timed_ms < INDUCTOR_WORTH_MS):
            return None
        return {**options, "whole_graph": True}, 0
    if compiled is None or options.get("engine") or options.get("whole_graph") is False:
        return None
    parts = manifest.get("partitions") or []
    if not parts or timed_ms is None or (manifest.get("engine") or {}).get("name") == "inductor":
        return None
    lost_to_eager = all(p.get("engine") == "eager" for p in parts)
    if not lost_to_eager and (timed_ms < INDUCTOR_WORTH_MS or any(p.get("engine") == "inductor" for p in parts)):
        return None
    from kiln import engines
    if engines.get("inductor", required=False) is None:
        return None
    return {**options, "engine": "inductor", "engine_by": "whole_graph"}, LOST_TO_EAGER_RUNS


def _one_engine(manifest) -> bool:
    """Whether the program is one partition and nothing on the host."""
    steps = (manifest.get("program") or {}).get("steps") or []
    return bool(steps) and len(manifest.get("partitions") or []) == 1 and all("partition" in s for s in steps)


def upgrade(gm, examples, name, options):
    """The whole-graph build of a program already running in partitions (``options`` with
    ``whole_graph=True``), compiled in the compile process; None where it is refused: the
    partitions keep running, with a warning naming why (and ``UpgradeRefused`` counted)."""
    def refused(why):
        metrics.count("UpgradeRefused")
        warnings.warn(f"kiln: graph '{name}': its whole-graph build was refused ({why}); "
                      "its partitions keep running", RuntimeWarning, stacklevel=3)
        return None
    return build_in_child(gm, examples, name, {**options, "whole_graph": True}, refused)


def faster(new, old) -> bool:
    """Whether the whole-graph build ``new`` should take over from the partitions ``old``:
    it was compiled (never back to running eagerly) and, where both were timed (-O2), its
    measured time is under the partitions' (theirs without the host operations between
    them, so a tie keeps the partitions). -O2 keeps eager's kernels for a graph Inductor does
    not run faster, which can be slower than the partitions were: that build is not taken
    (``UpgradeSlower``)."""
    compiled = getattr(new, "compiled", None)
    if compiled is None:
        return False
    def timed_ms(c):
        return (c.manifest.get("speed_vs_eager") or {}).get("latency_ms") if c is not None else None
    new_ms, old_ms = timed_ms(compiled), timed_ms(getattr(old, "compiled", None))
    if new_ms is None or old_ms is None or new_ms < old_ms:
        return True
    metrics.count("UpgradeSlower")
    return False


def _warn_misfit(name, misfit):
    warnings.warn(f"kiln: graph '{name}': the compile cache's entry does not fit it "
                  f"({misfit}); compiling it again", RuntimeWarning, stacklevel=4)


def _runner(gm, compiled, started, hit):
    """The callable running ``compiled`` in ``gm``'s place, counted in the metrics."""
    compiled.take_turns()      # it runs between host operations, never back to back
    metrics.sample("CompileTime", time.perf_counter() - started)
    metrics.count("CachedCompile" if hit else "UncachedCompile")
    # a backward graph returns None for inputs without gradients; the compiled graph
    # returns its tensors only, so the Nones are put back where the graph had them
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    present = [o is not None for o in outputs]
    ranges = compiled.index_ranges    # an index out of range is refused before any engine sees it
    aliased = output_aliases.plan(gm)   # outputs that are views of one another in eager
    # NaN or infinities the program was found at compile time to answer otherwise than eager
    # (compiler.checks.nonfinite_probe: a ReLU or max that turns NaN into a number): such a call
    # runs op by op, as eager would (kiln.trace's models refuse them; a training loop must go
    # on, its NaN loss as eager has it). Until 12-03 the program ran them: NaN lost, silently.
    nonfinite = getattr(compiled, "nonfinite", frozenset())

    def run(*args):
        t0 = time.perf_counter()
        if ranges:
            value_checks.check_ranges(args, ranges)
        if nonfinite and value_checks.any_nonfinite(args, nonfinite):
            metrics.count("NonfiniteEagerCalls")
            return _listed(gm(*args))
        flat = iter(compiled.run_flat(list(args)))
        out = [next(flat) if p else None for p in present]
        if aliased:
            out = output_aliases.rebuild(out, aliased)
        metrics.sample("ExecuteTime", time.perf_counter() - t0)
        return out
    run.compiled = compiled
    return run


def _misfit(compiled, gm) -> str | None:
    """Why a compiled model's outputs cannot be ``gm``'s (their shapes and dtypes against
    the graph's own metadata, where it has some), or None. A cache hit trusts its key;
    this catches a key that named the wrong entry (as one once did)."""
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = [o for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs]) if o is not None]
    vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else None for o in outputs]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    specs = compiled.output_specs
    if len(specs) != len(vals):
        return f"{len(specs)} outputs, the graph has {len(vals)}"
    for i, (spec, val) in enumerate(zip(specs, vals)):
        if tuple(spec.shape) != tuple(val.shape) or spec.dtype != val.dtype:
            return f"output {i} is {spec.dtype}{list(spec.shape)}, the graph's {val.dtype}{list(val.shape)}"
    return None


def _eager(gm, name, why):
    """``gm`` run op by op, with a warning saying ``why``; no warning when ``why`` is None
    (a build abandoned as the process exits: the program is not asked for again)."""
    if why is not None:
        warnings.warn(f"kiln: graph '{name}' runs eagerly (not compiled): {why}", RuntimeWarning, stacklevel=3)
        metrics.count("EagerGraphs")

    def run(*args):
        return _listed(gm(*args))
    run.compiled = None
    return run
