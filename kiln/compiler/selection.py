"""Engine selection per device partition: default rules, fallback, and -O3 measurement.

Selection knows no engine by name: it reads what each engine says about itself
(``kiln.engines.Engine``): where it runs and its place in the default order
(``devices``, ``priority``), whether it is the fallback after an engine the
user names, whether it quantizes, whether -O2 prefers it for attention.

Every build is run once on the partition's example inputs and compared with
eager before it can be chosen (unless ``validate=False``). -O1/-O2 take the
first engine of the default order that compiles the partition correctly (an
engine that rejects it is skipped with a note; the fallback engine, which runs
anything torch can, comes last); -O2 tries an engine that ``prefers_attention``
first for partitions with attention, and times a quantized partition on every engine
that quantizes it (:func:`times_quantizers`). -O3 compiles the partition with every
engine of the default order, and every variant an engine offers, cheapest first
(engines whose blobs are data, their variants, then engines that compile native
code) within the compile budget (``--compile-budget``: a candidate whose expected
build time exceeds what is left is skipped, one whose first calls are clearly
slower than the best so far is dropped), times the rest on this machine with the
same inputs (warm-up, then interleaved rounds of a few calls per engine, median
per engine) and keeps the fastest.

From -O2 up, eager (the partition run by PyTorch, ``REFERENCE``) is timed against
the build kept (:mod:`kiln.compiler.measure`); when it is faster by more than
``measure.MARGIN`` the partition runs on the eager engine, with a note, unless
the user named the engine. Int8 and auto-cast partitions are never compared.
Every attempt is recorded in the manifest so the choice can be checked against
its own numbers.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from kiln import engines
from kiln.compiler import measure
from kiln.compiler.options import CompileOptions
from kiln.compiler.checks import Misfit, Reference as _Reference, nonfinite_probe, try_run as _try_run
from kiln.graph import randomness
from kiln.errors import CompileError, CompilerArgsError, EngineUnavailableError, KilnError

# Partitions holding these ops have attention: -O2 gives them to an engine that
# ``prefers_attention`` first (measured faster there, see the engine).
ATTENTION_OPS = ("aten._softmax.default", "aten._safe_softmax.default",
                 "aten.scaled_dot_product_attention.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default")
ROUNDS, BLOCK = 5, 3
# The reference engine: the partition run by PyTorch. Every build is held to its answers,
# and from -O2 up to its speed (a partition no engine runs faster runs eagerly).
REFERENCE = "eager"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _devices(name) -> tuple:
    """Where engine ``name`` runs; an engine kiln does not know counts as a CPU engine
    (naming it fails later, with the registry's message)."""
    engine = engines.describe(name)
    return tuple(engine.devices) if engine is not None else ("cpu",)


def _quantizers(device: str, mode) -> list:
    return [e.name for e in engines.ranked(device) if mode in e.quantizes]


def resolve_device(opts):
    """Settle ``opts.device`` ("auto" becomes "cpu" or "cuda") before anything is keyed or compiled.

    "auto" means the GPU when torch sees one and the requested work can run
    there: an engine named by the user that does not run on GPUs, or int8
    quantization where no GPU engine quantizes, keeps the model on the CPU.
    Returns the options with the device settled (a new object; options are immutable).
    """
    if opts.device == "auto":
        cpu_only = ((opts.engine and "cuda" not in _devices(opts.engine))
                    or (opts.quantize and not _quantizers("cuda", opts.quantize)))
        return dataclasses.replace(opts, device="cuda" if not cpu_only and cuda_available() else "cpu")
    elif opts.device == "cuda":
        on_gpu = [e.name for e in engines.ranked("cuda")]
        if opts.engine and "cuda" not in _devices(opts.engine):
            raise CompilerArgsError(f"engine {opts.engine!r} runs on CPUs only; on device='cuda' kiln "
                                    f"compiles with {', '.join(on_gpu)}: drop engine= or use device='cpu'")
        if opts.quantize and not _quantizers("cuda", opts.quantize):
            raise CompilerArgsError("int8 quantization runs on CPU engines only: use device='cpu', or "
                                    "--auto-cast bf16/fp16 for reduced precision on the GPU")
        if not cuda_available():
            raise CompilerArgsError(
                f"device='cuda' but torch {torch.__version__} sees no CUDA device (a CPU-only build, "
                "no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides it); use device='cpu' or 'auto'")
    return opts


def default_order(opts) -> list:
    """The engines tried on ``opts.device``: the engine the user named, then the fallback
    engines; or, with none named, every engine with a priority there, in its order."""
    ranked = engines.ranked(opts.device)
    if opts.engine:
        return [opts.engine] + [e.name for e in ranked if e.fallback and e.name != opts.engine]
    return [e.name for e in ranked]


def named_by_user(opts) -> bool:
    """Whether the user named the engine: then a build is kept even where eager is faster.
    An engine a phase chose (``whole_graph``'s Inductor, auto-cast's native engine) is
    still held to eager's speed at -O2."""
    return bool(opts.engine) and opts.engine_by == "user"


def primary(opts):
    """The engine whose op support decides partitioning."""
    notes = []
    for name in default_order(opts):
        try:
            return engines.get(name), notes
        except EngineUnavailableError as e:
            if opts.engine == name:
                raise
            notes.append(str(e))
    raise EngineUnavailableError("no engine is installed: install onnxruntime, openvino or a C++ compiler")


def time_runners(runners: dict, inputs, left: float | None = None) -> dict:
    """-O3's timing: median ms per runner, interleaved rounds (see ``measure.time_runners``),
    shortened to ``left`` seconds of compile budget (``measure.final_timing``)."""
    limits = measure.final_timing(float("inf") if left is None else left, len(runners))
    return measure.time_runners(runners, inputs, rounds=ROUNDS, block=BLOCK, **limits)


def rule_order(opts, sub) -> list:
    """-O2's engine order for one partition: the default order, with the engines that
    prefer attention first when the partition has attention."""
    order = default_order(opts)
    if opts.optlevel == 2 and not opts.engine and has_attention(sub):
        first = [n for n in order if getattr(engines.describe(n), "prefers_attention", False)]
        order = first + [n for n in order if n not in first]
    return order


def candidate_order(opts, sub) -> list:
    """The engines to try on one partition, in order: -O3 measures the plain default
    order; a quantized partition goes only to engines that quantize (it must never
    silently become an fp32 one on another engine), and one that draws random numbers
    only to engines that draw them from PyTorch's generator (:mod:`kiln.graph.randomness`)."""
    order = rule_order(opts, sub)
    if opts.optlevel >= 3 and not opts.engine:
        order = default_order(opts)
    if randomness.draws_random(sub):
        # its draws must be eager's: only engines that call PyTorch's random kernels
        order = [n for n in order if getattr(engines.describe(n), "draws_from_torch", False)]
    if opts.quantize:
        able = [n for n in order if quantizes(engines.describe(n), opts)]
        if not able:
            others = [e.name for e in engines.ranked(opts.device) if quantizes(e, opts)]
            # the engine named (not the fallback engines behind it, which named themselves too)
            who = (f"{opts.engine} (engine={opts.engine!r} was named)" if opts.engine_by == "user" else
                   f"{opts.engine} (chosen for {opts.engine_by.replace('_', '-')})") if opts.engine else \
                " and ".join(order) or "no engine"
            raise CompilerArgsError(
                f"{who} cannot quantize to {opts.quantize} with quantize_mode={opts.quantize_mode!r}; engines "
                f"that can: {', '.join(others) or 'none'}")
        order = able
    return order


def quantizes(engine, opts) -> bool:
    """Whether ``engine`` (a description) implements ``opts``' quantization, mode included."""
    return (opts.quantize in getattr(engine, "quantizes", ())
            and opts.quantize_mode in getattr(engine, "quantize_modes", ("dynamic", "static", "weight_only")))


def default_quantizer(quantize: str, quantize_mode: str, device: str = "cpu") -> str | None:
    """The first engine in ``device``'s default order that implements this quantization."""
    opts = dataclasses.replace(CompileOptions(), quantize=quantize, quantize_mode=quantize_mode, device=device)
    return next((e.name for e in engines.ranked(device) if quantizes(e, opts)), None)


def times_quantizers(opts, order) -> bool:
    """-O2 times a quantized partition on every engine that quantizes it, and keeps the
    fastest: no rule picks well here. On SmolLM2's int4 graphs OpenVINO ran the 128-token
    prefill in about half ONNX Runtime's time and the one-token decode step in 1.4x its time
    (docs/performance.md), so the same model's graphs go to different engines."""
    return opts.optlevel == 2 and bool(opts.quantize) and not opts.engine and len(order) > 1


def has_attention(gm) -> bool:
    return any(node.op == "call_function" and str(node.target) in ATTENTION_OPS for node in gm.graph.nodes)


_EAGER_KEY = "(eager)"     # eager's runner among timed builds (not a build's key)


def versus_eager(opts) -> bool:
    """Whether builds are timed against eager: from -O2 up, on the CPU, for lossless
    compiles (eager neither quantizes nor casts), unless eager is what was asked for."""
    return (opts.optlevel >= 2 and not opts.quantize and opts.auto_cast == "none"
            and opts.device == "cpu" and opts.engine != REFERENCE
            and engines.get(REFERENCE, required=False) is not None)


class _Search:
    """One partition's search: every build tried, the ones kept, and the choice."""

    def __init__(self, sub, inputs, opts, runtime_opts, progress, label, calibration):
        self.sub, self.inputs, self.opts, self.runtime_opts = sub, inputs, opts, runtime_opts
        self.progress, self.label = progress, label
        self.calibration = calibration if opts.quantize else None
        self.measure = opts.optlevel >= 3
        self.why_measured = "fastest measured latency (-O3)"
        self.every = False             # build every candidate, whatever the budget
        self.reference = _Reference(sub, inputs, opts)
        self.attempts: list = []
        self.compiled: dict = {}       # key -> (engine, blob, attempt, runner)
        self.inaccurate: list = []
        self.budget = measure.Budget(opts, progress, sum(n.op == "call_function" for n in sub.graph.nodes))
        self.versus = versus_eager(opts)
        self.eager = measure.eager_runner(sub, runtime_opts.resolved_threads()) if self.versus else None
        self.eager_ms: float | None = None
        self.probes: dict = {}         # key -> ms of its first calls (-O3)
        self.note: str | None = None

    def engines(self, order):
        for name in order:
            try:
                yield engines.get(name)
            except EngineUnavailableError as e:
                self.attempts.append({"engine": name, "status": "unavailable", "note": str(e)})

    def run(self, order):
        if times_quantizers(self.opts, order):
            # in the default order (ONNX Runtime first: the other engines reuse its ONNX
            # model), each built whatever the budget says: the point is to time them all
            order = [n for n in default_order(self.opts) if n in order]
            self.measure, self.every = True, True
            self.why_measured = "fastest measured latency of the engines that quantize it (-O2)"
        if self.measure:
            return self.search(order)
        for engine in self.engines(order):
            if self.build(engine, None):
                return

    def search(self, order):
        """-O3: every engine and variant, cheapest first (data engines, their variants, then
        engines that compile native code); past the first good build, within the budget."""
        found = list(self.engines(order))
        variants = [(e, v) for e in found for v in (() if self.opts.quantize else e.variants(self.opts))]
        candidates = sorted([(e, None) for e in found] + variants,
                            key=lambda c: (bool(c[0].native_code), c[1] is not None, found.index(c[0])))
        if self.eager is not None:
            self.probes[_EAGER_KEY] = measure.probe(self.eager, self.inputs)
        named = self.opts.engine
        if named and any(e.name == named for e in found):
            # an engine the user (or a phase) named is kept: its variants are timed against
            # each other, and the engines behind it are tried only if none of them builds
            # (until 12-03, -O3 timed those too and could pick one: found by probing)
            self._try([c for c in candidates if c[0].name == named])
            if self.compiled:
                return
            candidates = [c for c in candidates if c[0].name != named]
        self._try(candidates)

    def _try(self, candidates):
        for engine, variant in candidates:
            key = engine.name if variant is None else f"{engine.name}:{variant}"
            why = self.budget.refusal(engine, key) if self.compiled and not self.every else None
            if why:
                self.attempts.append({"engine": engine.name, **({"variant": variant} if variant else {}),
                                      "status": "skipped", "note": why})
                continue
            with self.budget.shown():
                if self.build(engine, variant):
                    self.early_look(key)

    def early_look(self, key):
        """Drop a build whose first calls are already clearly slower than the best so far
        (never the first build: something must be kept)."""
        ms = measure.probe(self.compiled[key][3], self.inputs)
        best = min(self.probes.values(), default=None)
        self.probes[key] = ms
        if best is not None and len(self.compiled) > 1 and ms > measure.DROP * best:
            attempt = self.compiled.pop(key)[2]
            attempt.update(status="dropped", probe_ms=round(ms, 4),
                           note=f"dropped: {ms:.3g} ms over its first {measure.PROBE_CALLS} calls, "
                                f"best so far {best:.3g} ms")

    def build(self, engine, variant) -> bool:
        """Compile and check one build; True when it may be chosen."""
        key = engine.name if variant is None else f"{engine.name}:{variant}"
        attempt = {"engine": engine.name, **({"variant": variant} if variant else {})}
        with self.progress.phase(f"compile {self.label} ({key})"):
            t0 = time.perf_counter()
            try:
                blob = engine.compile(self.sub, self.inputs, self.opts, variant=variant,
                                      calibration=self.calibration)
            except KilnError:
                raise
            except Exception as e:
                self.attempts.append({**attempt, "status": "failed",
                                      "compile_seconds": round(time.perf_counter() - t0, 3),
                                      "note": f"{type(e).__name__}: {str(e).strip()[:500]}"})
                return False
            seconds = time.perf_counter() - t0
        self.budget.built(engine, seconds)
        attempt.update({"engine_version": engine.version(), "status": "ok",
                        "compile_seconds": round(seconds, 3)})
        self.attempts.append(attempt)
        runner = None
        if self.opts.validate or self.measure:
            with self.progress.phase(f"check {self.label} ({key})"):
                runner, problem = _try_run(engine, blob, self.runtime_opts, self.inputs,
                                           self.reference, self.opts)
            if problem:
                attempt.update(status="inaccurate", note=str(problem))
                if runner is not None and not isinstance(problem, Misfit):
                    self.inaccurate.append((engine, blob, attempt, runner))
                return False
            # the reference engine runs eager's own kernels: it answers NaN and infinities as
            # eager does, and probing it cost a BERT-4L step's partition 14 s (11-28)
            if self.opts.validate and engine.name != REFERENCE:
                with self.progress.phase(f"probe {self.label} ({key})"):
                    nonfinite = nonfinite_probe(runner, self.reference, self.opts)
                if nonfinite is not None:
                    attempt["nonfinite"] = nonfinite
        self.compiled[key] = (engine, blob, attempt, runner)
        return True

    def choose(self, order):
        """(engine, blob, attempt, runner) of the build kept, and why it was."""
        if self.measure and self.compiled:
            return self.against_eager(*self.fastest())
        if self.compiled:
            chosen = next(iter(self.compiled.values()))
            self.time_with_eager(chosen)
            return self.against_eager(chosen, self._rule_reason(order))
        if self.inaccurate:
            # No engine matched eager here: keep the first build, and let the model's
            # validation gate report the numbers (a tolerance set too tight, for one).
            return self.inaccurate[0], ("no engine matched eager on this partition within tolerance; "
                                        "kept the first that ran, for the validation gate to report")
        detail = "; ".join(f"{a['engine']}: {a.get('note', a['status'])}" for a in self.attempts)
        raise CompileError(f"no engine could compile {self.label}: {detail}")

    def fastest(self):
        runners = {n: c[3] for n, c in self.compiled.items()}
        if self.eager is not None:
            runners[_EAGER_KEY] = self.eager
        with self.progress.phase(f"time {self.label} ({', '.join(runners)})"):
            ms = time_runners(runners, self.inputs, self.budget.left())
        for n, c in self.compiled.items():
            c[2]["latency_ms"] = round(ms[n], 4)
        self.eager_ms = ms.get(_EAGER_KEY)
        return (min(self.compiled.values(), key=lambda c: c[2]["latency_ms"]), self.why_measured)

    def time_with_eager(self, chosen):
        """-O2: the rule's build and eager, in turns, within a small cap."""
        runner, attempt = chosen[3], chosen[2]
        if self.eager is None or runner is None:
            return
        # never skipped (it is what keeps -O2 from being slower than eager); a spent
        # budget only shortens it to its floor
        cap = min(measure.COMPARE_SECONDS, max(self.budget.left(), measure.COMPARE_FLOOR))
        with self.progress.phase(f"time {self.label} ({chosen[0].name} vs eager)"):
            build_ms, self.eager_ms = measure.compare(runner, self.eager, self.inputs, cap)
        attempt["latency_ms"] = round(build_ms, 4)

    def against_eager(self, chosen, reason):
        """The build kept, or eager's when eager is faster by more than the margin (unless
        the user named the engine)."""
        if self.eager_ms is None:
            return chosen, reason
        ms = chosen[2]["latency_ms"]
        if named_by_user(self.opts) or not measure.eager_wins(ms, self.eager_ms):
            self.attempts.append({"engine": REFERENCE, "status": "timed", "latency_ms": round(self.eager_ms, 4),
                                  "note": "the partition run by PyTorch, timed for comparison; not built"})
            return chosen, reason
        engine, attempt = chosen[0], chosen[2]
        name = engine.name + (f":{attempt['variant']}" if attempt.get("variant") else "")
        reference = engines.get(REFERENCE)
        if not self.build(reference, None):
            return chosen, reason
        eager = self.compiled[REFERENCE]
        if eager[3] is not None and chosen[3] is not None:
            # eager was timed as the bare partition; its engine's build has a little per-call
            # overhead of its own: it must still win, timed as it will run
            with self.progress.phase(f"time {self.label} ({name} vs {REFERENCE})"):
                ms, self.eager_ms = measure.compare(chosen[3], eager[3], self.inputs, measure.COMPARE_SECONDS)
            chosen[2]["latency_ms"] = round(ms, 4)
            if not measure.eager_wins(ms, self.eager_ms):
                del self.compiled[REFERENCE]
                eager[2].update(latency_ms=round(self.eager_ms, 4),
                                note=f"built; timed as it runs, not faster than {name} by the margin")
                return chosen, reason
        eager[2]["latency_ms"] = round(self.eager_ms, 4)
        self.note = (f"{self.label} runs eagerly: {name} {ms:.3g} ms vs eager {self.eager_ms:.3g} ms")
        return eager, (f"PyTorch eager is faster on this partition: {name} {ms:.3g} ms vs eager "
                       f"{self.eager_ms:.3g} ms (more than the {measure.MARGIN:.0%} margin)")

    def _rule_reason(self, order) -> str:
        if len(self.attempts) > 1:
            return "first engine that compiled it correctly, after " + ", ".join(
                f"{a['engine']} {a['status']}" for a in self.attempts[:-1])
        if named_by_user(self.opts):
            return "engine chosen by the user"
        if self.opts.engine:
            return {"whole_graph": "the whole graph on the engine that takes every operation (whole_graph)",
                    "auto_cast": "the engine that computes the auto-cast type natively"}.get(
                        self.opts.engine_by, f"engine chosen by {self.opts.engine_by}")
        if order[0] != default_order(self.opts)[0]:
            return "default engine for attention partitions (-O2)"
        return "default engine (-O1/-O2)"


def compile_partition(index, sub, inputs, opts, runtime_opts, progress, label, calibration=None):
    """Return (engine, blob, record, runner) for one partition: ``runner`` is the blob as
    the checks loaded it with ``runtime_opts`` (None if they did not). ``calibration``:
    partition input lists for calibrated int8 (used only when ``opts.quantize``)."""
    order = candidate_order(opts, sub)
    search = _Search(sub, inputs, opts, runtime_opts, progress, label, calibration)
    search.run(order)
    (engine, blob, chosen, runner), reason = search.choose(order)
    record = {"engine": engine.name, **({"variant": chosen["variant"]} if "variant" in chosen else {}),
              **({"nonfinite": chosen["nonfinite"]} if "nonfinite" in chosen else {}),
              "engine_version": engine.version(),
              "compile_seconds": chosen["compile_seconds"], "choice": reason, "candidates": search.attempts}
    if search.eager_ms is not None and chosen.get("latency_ms"):
        eager_ms = round(search.eager_ms, 4)       # the ratio of the numbers recorded, so eager is 1.0
        record.update(latency_ms=chosen["latency_ms"], eager_latency_ms=eager_ms,
                      speed_vs_eager=float(f"{eager_ms / chosen['latency_ms']:.4g}"))
    if search.note:
        record["note"] = search.note
    if opts.quantize:
        products = engine.quantized_products(blob)
        if products is not None:
            record["quantized"] = products
    return engine, blob, record, runner
