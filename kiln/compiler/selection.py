"""Engine selection per device partition: default rules, fallback, and -O3 measurement.

Every build is run once on the partition's example inputs and compared with
eager before it can be chosen (unless ``validate=False``). -O1/-O2 take the
first engine of the default order that compiles the partition correctly (an
engine that rejects it is skipped with a note, TorchInductor last: it runs
anything torch can); -O2 tries OpenVINO first for partitions with attention.
-O3 compiles the partition with every available engine, and every variant an
engine offers, times them on this machine with the same inputs (warm-up, then
interleaved rounds of a few calls per engine, median per engine) and keeps the
fastest. Every attempt is recorded in the manifest so the choice can be
checked against its own numbers.
"""
from __future__ import annotations

import statistics
import time

import torch

from kiln import engines as backends
from kiln.errors import CompileError, CompilerArgsError, EngineUnavailableError, KilnError

# Measured on our CPUs (docs/performance.md): neither engine wins everywhere. ONNX
# Runtime is faster on ResNet-50 (39.5 vs 53.2 ms) and OpenVINO on BERT-base (113.6
# vs 138.8 ms); ONNX Runtime covers the most ops, so it leads the default order and
# -O3 measures. TorchInductor compiles C++ and is slowest to build: last resort on CPU.
CPU_ORDER = ("onnxruntime", "openvino", "inductor")
# -O2's one exception, also measured: partitions with attention (a softmax) go to
# OpenVINO first. all-MiniLM-L6-v2 ran 38 ms on OpenVINO against 58 on ONNX Runtime
# (0.75x eager), BERT-base 110-133 against 131-149 ms.
ATTENTION_OPS = ("aten._softmax.default", "aten._safe_softmax.default",
                 "aten.scaled_dot_product_attention.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default")
# On an NVIDIA GPU only TorchInductor generates code (Triton kernels + cuBLAS);
# the ONNX Runtime and OpenVINO packages kiln depends on are CPU builds.
CUDA_ORDER = ("inductor",)
WARMUP, ROUNDS, BLOCK, MAX_SECONDS = 3, 5, 3, 3.0
QUANTIZING = ("onnxruntime",)  # engines whose compile() implements quantize="int8"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(opts):
    """Settle ``opts.device`` ("auto" becomes "cpu" or "cuda") before anything is keyed or compiled.

    "auto" means the GPU when torch sees one and the requested work can run
    there: an engine named by the user that only runs on CPUs, or int8
    quantization (a CPU engine feature), keeps the model on the CPU.
    """
    if opts.device == "auto":
        cpu_only = (opts.engine and opts.engine not in CUDA_ORDER) or opts.quantize
        opts.device = "cuda" if not cpu_only and cuda_available() else "cpu"
    elif opts.device == "cuda":
        if opts.engine and opts.engine not in CUDA_ORDER:
            raise CompilerArgsError(f"engine {opts.engine!r} runs on CPUs only; on device='cuda' kiln "
                                    f"compiles with {', '.join(CUDA_ORDER)}: drop engine= or use device='cpu'")
        if opts.quantize:
            raise CompilerArgsError("int8 quantization runs on CPU engines only: use device='cpu', or "
                                    "--auto-cast bf16/fp16 for reduced precision on the GPU")
        if not cuda_available():
            raise CompilerArgsError(
                f"device='cuda' but torch {torch.__version__} sees no CUDA device (a CPU-only build, "
                "no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides it); use device='cpu' or 'auto'")
    return opts


def default_order(opts) -> list:
    if opts.device == "cuda":
        return list(CUDA_ORDER)
    if opts.engine:
        rest = [e for e in ("inductor",) if e != opts.engine]
        return [opts.engine] + rest
    return list(CPU_ORDER)


def primary(opts):
    """The engine whose op support decides partitioning."""
    notes = []
    for name in default_order(opts):
        try:
            return backends.get(name), notes
        except EngineUnavailableError as e:
            if opts.engine == name:
                raise
            notes.append(str(e))
    raise EngineUnavailableError("no engine is installed: install onnxruntime, openvino or a C++ compiler")


def time_runners(runners: dict, inputs) -> dict:
    """Median latency in ms per runner: warm-up, then rounds that take turns, each
    runner timing a block of BLOCK calls after one untimed call.

    Interleaving matters on shared machines: a burst of background load hits
    every candidate alike instead of deciding the winner on its own. The
    untimed call matters because engines leave their threads busy-waiting for
    work after a call (ONNX Runtime's spinning, OpenMP's wait policy): the
    next engine's first call competes with them, which once timed OpenVINO at
    224 ms for a 133 ms BERT-base when it ran right after ONNX Runtime.
    """
    for runner in runners.values():
        for _ in range(WARMUP):
            runner(inputs)
    samples: dict = {name: [] for name in runners}
    deadline = time.perf_counter() + MAX_SECONDS * len(runners)
    for i in range(ROUNDS):
        if i >= 2 and time.perf_counter() > deadline:
            break
        for name, runner in runners.items():
            runner(inputs)
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                runner(inputs)
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def rule_order(opts, sub) -> list:
    """-O2's engine order for one partition: the default order, with OpenVINO first for attention."""
    order = default_order(opts)
    if opts.optlevel == 2 and not opts.engine and "openvino" in order and has_attention(sub):
        order = ["openvino"] + [e for e in order if e != "openvino"]
    return order


def has_attention(gm) -> bool:
    return any(node.op == "call_function" and str(node.target) in ATTENTION_OPS for node in gm.graph.nodes)


_SATURATED = 1e30


class _Reference:
    """The partition's eager outputs on its example inputs, computed once, when first needed."""

    def __init__(self, sub, inputs):
        self.sub, self.inputs, self._outputs = sub, inputs, None

    def outputs(self) -> list:
        if self._outputs is None:
            with torch.no_grad():
                out = self.sub(*self.inputs)
            self._outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        return self._outputs


def _try_run(backend, blob, runtime_opts, inputs, reference, opts):
    """(runner, None), or (runner or None, why) when the engine cannot run its own build or
    answers differently from eager on the partition's example inputs.

    Checked per partition so that the next engine gets a partition the first
    one gets wrong: OpenVINO 2026.4 answered 18 of the 144 two-stage cuts of a
    tiny BERT pipeline wrongly (errors up to 3.7, or NaN), where ONNX Runtime ran
    all of them right. Lossy compiles (int8, auto-cast) are held to the model's
    accuracy gate instead; here they must only not invent NaN. When no engine
    agrees, the first that ran is kept and the model's validation reports it.
    """
    try:
        runner = backend.load(blob, runtime_opts)
        actual = runner(list(inputs))
    except KilnError:
        raise
    except Exception as e:
        return None, f"compiled, but could not run: {type(e).__name__}: {str(e).strip()[:300]}"
    expected = reference.outputs()
    problem = _disagreement(expected, actual, opts)
    return runner, problem


# (values refused if the probe differs, what goes in the last two elements of an input)
_NONFINITE = ((("nan",), (float("nan"), float("nan"))),
              (("+inf",), (float("inf"), float("inf"))),
              (("-inf",), (float("-inf"), float("-inf"))),
              (("+inf", "-inf"), (float("inf"), float("-inf"))))


def nonfinite_probe(runner, reference, opts) -> list | None:
    """Which of NaN, +inf and -inf in a float input this build does not answer as eager does.

    Engines differ from PyTorch here and the example inputs never show it: OpenVINO's
    ReLU, clamp, max-pool and softmax turn NaN into numbers (so also the NaN that two
    infinities make in a matmul), ONNX Runtime's ReduceMax and ArgMax skip NaN unless it
    comes first. Each value goes in the last two elements of a float input (last: a max
    that starts from the first element skips it; two: inf - inf inside), one input at a
    time (NaN in every input at once can hide one that a max skips), and the NaN pattern
    and the rest are compared with eager. A build that mishandles NaN gets the infinities
    listed as well: inside the graph they become NaN (inf - inf, 0 * inf) in ways no probe
    covers. The runtime refuses inputs holding the values listed (``InputError``) rather
    than answer differently from PyTorch. None when there is nothing to probe (no float
    inputs, lossy compiles).
    """
    inputs = reference.inputs
    floats = [i for i, t in enumerate(inputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floats or opts.quantize or opts.auto_cast != "none":
        return None
    differs: list = []
    for labels, values in _NONFINITE:
        if all(label in differs for label in labels):
            continue
        for i in floats[:_PROBED_INPUTS]:
            probe = list(inputs)
            probe[i] = inputs[i].detach().contiguous().clone()
            flat = probe[i].view(-1)
            for k, value in enumerate(values[:flat.numel()]):
                flat[-1 - k] = value
            with torch.no_grad():
                out = reference.sub(*probe)
            expected = list(out) if isinstance(out, (list, tuple)) else [out]
            try:
                actual = runner(probe)
            except Exception:  # noqa: BLE001 - an engine that cannot run such values differs
                actual = None
            if actual is None or _nonfinite_disagreement(expected, actual, opts):
                differs += [label for label in labels if label not in differs]
                break
        if "nan" in differs:
            # arithmetic makes NaN of infinities (inf - inf, 0 * inf) anywhere inside, and
            # this build mishandles NaN: no probe can show every such case, so refuse them
            return ["nan", "+inf", "-inf"]
    return differs


_PROBED_INPUTS = 4      # bounds the probe's runs: 3 values x this many float inputs


def _nonfinite_disagreement(expected, actual, opts) -> bool:
    for e, a in zip(expected, actual):
        if not isinstance(e, torch.Tensor):
            continue
        if tuple(a.shape) != tuple(e.shape):
            return True
        a = a.to(e.dtype)
        if e.is_floating_point() and not torch.equal(e.isnan(), a.isnan()):
            return True
    return _disagreement(expected, actual, opts) is not None


def _disagreement(expected, actual, opts) -> str | None:
    lossy = bool(opts.quantize) or opts.auto_cast != "none"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor):
            continue
        if tuple(a.shape) != tuple(e.shape):
            return f"output {i} has shape {tuple(a.shape)}, eager {tuple(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(e, a.to(e.dtype)):
                return f"integer output {i} differs from eager"
            continue
        a = a.to(e.dtype)
        if (a.isnan() & ~e.isnan()).any():
            return f"output {i} has NaN where eager has none"
        # Mask arithmetic saturates: -inf and float32's lowest both mean "masked out",
        # and engines legitimately disagree on which one a partition returns.
        e, a = (t.nan_to_num(nan=0.0).clamp(-_SATURATED, _SATURATED) for t in (e, a))
        if not lossy and not torch.allclose(a, e, atol=opts.atol, rtol=opts.rtol):
            err = (a.double() - e.double()).abs().max().item()
            return f"output {i} differs from eager: max abs error {err:.3g} (atol {opts.atol:g}, rtol {opts.rtol:g})"
    return None


def compile_partition(index, sub, inputs, opts, runtime_opts, progress, label, calibration=None):
    """Return (backend, blob, record) for one partition."""
    measure = opts.optlevel >= 3
    order = rule_order(opts, sub)
    if measure and not opts.engine and opts.device != "cuda":
        order = list(CPU_ORDER)
    extra = {}
    if opts.quantize:
        # A quantized artifact must never silently become an fp32 one on another engine.
        extra["calibration"] = calibration
        order = [e for e in order if e in QUANTIZING]
    attempts, best, compiled, inaccurate = [], None, {}, []
    reference = _Reference(sub, inputs)
    for name in order:
        try:
            backend = backends.get(name)
        except EngineUnavailableError as e:
            attempts.append({"engine": name, "status": "unavailable", "note": str(e)})
            continue
        variants = (None,) + (tuple(backend.variants(opts)) if measure and not opts.quantize else ())
        for variant in variants:
            key = name if variant is None else f"{name}:{variant}"
            kw = dict(extra, **({"variant": variant} if variant else {}))
            attempt = {"engine": name, **({"variant": variant} if variant else {})}
            with progress.phase(f"compile {label} ({key})"):
                t0 = time.perf_counter()
                try:
                    blob = backend.compile(sub, inputs, opts, **kw)
                except KilnError:
                    raise
                except Exception as e:
                    attempts.append({**attempt, "status": "failed",
                                     "compile_seconds": round(time.perf_counter() - t0, 3),
                                     "note": f"{type(e).__name__}: {str(e).strip()[:500]}"})
                    continue
                seconds = time.perf_counter() - t0
            attempt.update({"engine_version": backend.version(), "status": "ok",
                            "compile_seconds": round(seconds, 3)})
            attempts.append(attempt)
            runner = None
            if opts.validate or measure:
                with progress.phase(f"check {label} ({key})"):
                    runner, problem = _try_run(backend, blob, runtime_opts, inputs, reference, opts)
                if problem:
                    attempt.update(status="inaccurate", note=problem)
                    if runner is not None:
                        inaccurate.append((backend, blob, attempt, runner))
                    continue
                if opts.validate:
                    nonfinite = nonfinite_probe(runner, reference, opts)
                    if nonfinite is not None:
                        attempt["nonfinite"] = nonfinite
            compiled[key] = (backend, blob, attempt, runner)
            if not measure:
                break
        if compiled and not measure:
            best = next(iter(compiled.values()))
            break
    if measure and compiled:
        with progress.phase(f"time {label} ({', '.join(compiled)})"):
            runners = {n: c[3] for n, c in compiled.items()}
            for n, ms in time_runners(runners, inputs).items():
                compiled[n][2]["latency_ms"] = round(ms, 4)
        best = min(compiled.values(), key=lambda c: c[2]["latency_ms"])
    fallback = best is None and inaccurate
    if fallback:
        # No engine matched eager here: keep the first build, and let the model's
        # validation gate report the numbers (a tolerance set too tight, for one).
        best = inaccurate[0]
    if best is None:
        detail = "; ".join(f"{a['engine']}: {a.get('note', a['status'])}" for a in attempts)
        raise CompileError(f"no engine could compile {label}: {detail}")
    backend, blob, chosen, _ = best
    if fallback:
        reason = ("no engine matched eager on this partition within tolerance; kept the first "
                  "that ran, for the validation gate to report")
    elif measure:
        reason = "fastest measured latency (-O3)"
    elif len(attempts) > 1:
        reason = "first engine that compiled it correctly, after " + ", ".join(
            f"{a['engine']} {a['status']}" for a in attempts[:-1])
    elif opts.engine:
        reason = "engine chosen by the user"
    elif order[0] != default_order(opts)[0]:
        reason = "default engine for attention partitions (-O2)"
    else:
        reason = "default engine (-O1/-O2)"
    record = {"engine": backend.name, **({"variant": chosen["variant"]} if "variant" in chosen else {}),
              **({"nonfinite": chosen["nonfinite"]} if "nonfinite" in chosen else {}),
              "engine_version": backend.version(),
              "compile_seconds": chosen["compile_seconds"], "choice": reason, "candidates": attempts}
    return backend, blob, record
