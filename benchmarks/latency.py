#!/usr/bin/env python
"""Latency benchmark: kiln against the usual ways of running a PyTorch model on CPU.

Models (random weights built from transformers configs; nothing is downloaded):

* ``resnet50``  - ``ResNetModel(ResNetConfig())`` (ResNet-50), input 1x3x224x224 fp32
* ``bert-base`` - ``BertModel(BertConfig())``, batch 1, seq 128, input_ids + attention_mask (int64)

Runners, all in one process, on the same model object and the same inputs:

* ``eager``          PyTorch eager under ``torch.inference_mode()`` (the baseline of every speedup)
* ``torchscript``    ``torch.jit.trace`` + ``torch.jit.freeze``
* ``torch.compile``  default (inductor) backend; a failure is recorded and the runner skipped
* ``kiln``           ``kiln.trace(...)``, called as ``compiled(...)``, the normal checked path
* ``ort-direct``     an ``onnxruntime.InferenceSession`` built here from kiln's own stored blob,
                     with kiln's session options (ORT_DISABLE_ALL: the blob is already
                     optimised; same thread counts), fed NumPy arrays directly. kiln over this
                     is kiln's own wrapper overhead over the exact session it wraps.
* ``ort-export``     an independent ``torch.onnx.export(..., dynamo=True)`` run by ONNX Runtime
                     with ORT_ENABLE_ALL (optional; skipped with a note if it fails)

Method: every runner is built and called once (output checked against eager), then warmed
up (``--warmup`` calls). Timed calls are split into ``--rounds`` blocks; each round runs
one block of every runner, in a seeded shuffled order, so slow drift of the machine (turbo,
thermal, noisy neighbours) spreads over all runners instead of landing on one. kiln and
ort-direct get equal call counts and run back to back in every round. The first call of
every block is discarded (thread pools of the previous runner spinning down); the garbage
collector is off inside timed blocks. The CPU use of other processes is sampled before and
after timing and a warning is printed when the machine was not idle.
Reported: median and p90 of the timed calls, speedup = eager median / runner median,
kiln overhead = (kiln median / ort-direct median - 1) * 100 % (plus, in the JSON and the
summary line, a per-round paired estimate: the median over rounds of the ratio of the two
back-to-back blocks). Raw samples are kept in the JSON.

Targets: kiln >= 1.5x eager, kiln overhead over ort-direct <= 3 %.

Usage::

    python benchmarks/latency.py                      # full run (several minutes on 2 cores)
    python benchmarks/latency.py --quick              # tiny configs, smoke test (~1 minute)
    python benchmarks/latency.py --models bert-base --iters 200 --warmup 20
    python benchmarks/latency.py --json benchmarks/results/latency.json

Results are printed as a table and written as JSON (default
``benchmarks/results/latency.json``; ``latency-quick.json`` with ``--quick``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # benchmark the working tree, not some installed copy
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TARGET_SPEEDUP = 1.5      # kiln median must be at least this much faster than eager
TARGET_OVERHEAD_PCT = 3.0  # kiln median may be at most this much slower than ORT on its own blob

RUNNERS = [
    ("eager", "PyTorch eager (inference_mode)"),
    ("torchscript", "TorchScript (jit.trace + freeze)"),
    ("torch.compile", "torch.compile (inductor)"),
    ("kiln", "kiln"),
    ("ort-direct", "ONNX Runtime direct (kiln's blob)"),
    ("ort-export", "onnxruntime (torch.onnx.export + ORT_ENABLE_ALL)"),
]
LABELS = dict(RUNNERS)
MODELS = ("resnet50", "bert-base")


# ---------------------------------------------------------------------------------------------
# helpers

def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet():
    """Silence exporter / compiler chatter (stdout, warnings, chatty loggers)."""
    from kiln.quiet import EXPORTER_LOGGERS, quiet as kiln_quiet
    return kiln_quiet(EXPORTER_LOGGERS + ("torch._inductor", "torch._dynamo", "torch.export", "transformers"))


def short_error(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def flat_tensors(out) -> list:
    """All tensors of a model output (ModelOutput, dict, tuple, tensor, numpy) in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, np.ndarray):
        return [torch.from_numpy(out)]
    if isinstance(out, dict):  # ModelOutput is an OrderedDict
        return [t for v in out.values() for t in flat_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in flat_tensors(v)]
    return []


def max_abs_diff(reference, out) -> float | None:
    """Largest |difference| over the reference outputs, matching outputs by shape.

    Engines may return outputs in another order (an ORT session's output order is the
    graph's, not the model's), so each reference tensor is compared with the closest
    output of the same shape.
    """
    refs, outs = flat_tensors(reference), flat_tensors(out)
    if not refs or not outs:
        return None
    worst = 0.0
    for r in refs:
        cands = [o for o in outs if tuple(o.shape) == tuple(r.shape)]
        if not cands:
            return None
        worst = max(worst, min(float((o.float() - r.float()).abs().max()) for o in cands))
    return worst


def display_path(path) -> str:
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values), q))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "vnni")))
    except OSError:
        pass
    return []


def machine_info(threads: int) -> dict:
    info = {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cpus": os.cpu_count(),
        "cpus_in_affinity": available_cpus(),
        "threads_used": threads,
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    try:
        import psutil
        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # noqa: BLE001
        pass
    for mod in ("onnxruntime", "onnx", "onnxscript", "transformers", "kiln"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable ({short_error(e, 80)})"
    try:
        info["kiln_git_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kiln"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["kiln_git_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        pass
    return info


def background_load(seconds: float = 1.0) -> dict:
    """CPU used by *other* processes while this one sleeps: timings on a busy machine are noisy.

    Returns the machine-wide busy percentage (100 = every CPU busy), the load average and the
    busiest other processes (name, pid, % of one CPU).
    """
    out: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    try:
        import psutil
        me = os.getpid()
        procs = []
        for pr in psutil.process_iter(["name"]):
            if pr.pid == me:
                continue
            try:
                pr.cpu_percent(None)
                procs.append(pr)
            except psutil.Error:
                pass
        psutil.cpu_percent(None)
        time.sleep(seconds)
        out["busy_pct_of_all_cpus"] = round(psutil.cpu_percent(None), 1)
        top = []
        for pr in procs:
            try:
                c = pr.cpu_percent(None)
            except psutil.Error:
                continue
            if c >= 5:
                try:
                    ours = pr.ppid() == me  # e.g. inductor's compile workers
                except psutil.Error:
                    ours = False
                top.append({"name": pr.info.get("name"), "pid": pr.pid, "cpu_pct": round(c, 1),
                            "child_of_benchmark": ours})
        out["busy_processes"] = sorted(top, key=lambda d: -d["cpu_pct"])[:5]
    except Exception as e:  # noqa: BLE001
        out["error"] = short_error(e, 120)
    return out


def load_warning(load: dict) -> str | None:
    busy = load.get("busy_pct_of_all_cpus")
    if busy is None or busy < 10:
        return None
    who = ", ".join(f"{p['name']}({p['pid']}) {p['cpu_pct']:.0f}%" for p in load.get("busy_processes", []))
    return (f"other processes kept {busy:.0f}% of the CPUs busy" + (f" (by {who})" if who else "")
            + "; timings are noisy, rerun on an idle machine")


# ---------------------------------------------------------------------------------------------
# models

@dataclass
class Case:
    name: str
    description: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    load_before: dict | None = None
    load_after: dict | None = None

    @property
    def example(self):
        """What kiln.trace takes: a dict of keyword inputs, or the positional tuple."""
        return dict(self.kwargs) if self.kwargs else tuple(self.args)

    def flat_inputs(self) -> list:
        return list(self.args) + list(self.kwargs.values())

    def input_desc(self) -> dict:
        names = [f"arg{i}" for i in range(len(self.args))] + list(self.kwargs)
        return {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for n, t in zip(names, self.flat_inputs())}


def build_case(name: str, quick: bool, seed: int) -> Case:
    seed_everything(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetModel
        if quick:
            cfg = ResNetConfig(embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1])
            size, desc = 64, "ResNet (tiny config), 1x3x64x64 fp32"
        else:
            cfg = ResNetConfig()
            size, desc = 224, "ResNet-50 (ResNetConfig() defaults), 1x3x224x224 fp32"
        model = ResNetModel(cfg).eval()
        x = torch.randn(1, 3, size, size, generator=g)
        return Case(name, desc, model, (x,), {})
    if name == "bert-base":
        from transformers import BertConfig, BertModel
        if quick:
            cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128, max_position_embeddings=128)
            seq, desc = 32, "BERT (tiny config), batch 1, seq 32, fp32"
        else:
            cfg = BertConfig()
            seq, desc = 128, "BERT-base (BertConfig() defaults), batch 1, seq 128, fp32"
        model = BertModel(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g, dtype=torch.int64)
        mask = torch.ones(1, seq, dtype=torch.int64)
        attn = getattr(model.config, "_attn_implementation", None)
        if attn:
            desc += f", attention={attn}"
        return Case(name, desc, model, (), {"input_ids": ids, "attention_mask": mask})
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


# ---------------------------------------------------------------------------------------------
# runners

@dataclass
class Runner:
    key: str
    label: str
    fn: object = None              # zero-argument callable running one inference
    status: str = "ok"             # ok | error | skipped
    error: str | None = None
    setup_seconds: float | None = None
    max_abs_diff: float | None = None
    note: str | None = None
    iters: int = 0
    samples: list = field(default_factory=list)
    blocks: list = field(default_factory=list)   # the samples of each round
    extra: dict = field(default_factory=dict)

    def fail(self, e: BaseException, status="error"):
        self.status, self.error, self.fn = status, short_error(e), None
        self.extra["traceback"] = traceback.format_exc(limit=8)[-4000:]


def make_eager(case: Case, threads: int):
    model, args, kwargs = case.model, case.args, case.kwargs

    def run():
        with torch.inference_mode():
            return model(*args, **kwargs)
    return run, {}


def make_torchscript(case: Case, threads: int):
    model, args, kwargs = case.model, case.args, case.kwargs
    extra = {}
    with torch.no_grad(), quiet():
        try:
            if kwargs:
                traced = torch.jit.trace(model, example_kwarg_inputs=dict(kwargs), strict=False)
            else:
                traced = torch.jit.trace(model, tuple(args), strict=False)
            extra["trace"] = "strict=False"
        except Exception as first:  # noqa: BLE001
            # HF models can also be traced as a tuple-returning function of positional inputs.
            names = list(kwargs)

            class TupleOut(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, *values):
                    out = self.m(*values[:len(args)], **dict(zip(names, values[len(args):])),
                                 return_dict=False)
                    return tuple(out)

            traced = torch.jit.trace(TupleOut(model).eval(), tuple(case.flat_inputs()))
            extra["trace"] = f"tuple wrapper (strict=False failed: {short_error(first, 120)})"
            kwargs_for_call, args_for_call = {}, tuple(case.flat_inputs())
        else:
            kwargs_for_call, args_for_call = kwargs, args
        frozen = torch.jit.freeze(traced.eval())

    def run():
        with torch.inference_mode():
            return frozen(*args_for_call, **kwargs_for_call)
    return run, extra


def make_torch_compile(case: Case, threads: int):
    model, args, kwargs = case.model, case.args, case.kwargs
    compiled = torch.compile(model)  # default backend: inductor

    def run():
        # no_grad rather than inference_mode: inference tensors entering a dynamo graph can
        # force guards/recompiles; no_grad gives inductor the same inference graph.
        with torch.no_grad():
            return compiled(*args, **kwargs)
    with quiet():
        run()  # compile happens on the first call; count it as setup
    return run, {"backend": "inductor", "grad_mode": "no_grad"}


def make_kiln(case: Case, threads: int):
    import kiln
    compiled = kiln.trace(case.model, case.example, quiet=True, threads=threads)
    args, kwargs = case.args, case.kwargs

    def run():
        return compiled(*args, **kwargs)
    m = compiled.manifest
    extra = {
        "compiled": compiled,
        "compile_seconds": m.get("compile_seconds"),
        "phases": m.get("phases"),
        "partitions": len(m.get("partitions", [])),
        "host_ops": len([s for s in m.get("program", {}).get("steps", []) if "op" in s]),
        "validation": m.get("validation"),
        "blob_bytes": sum(len(compiled._artifact.blobs[p["blob"]]) for p in m.get("partitions", [])),
    }
    return run, extra


def ort_session(model_bytes: bytes, threads: int, level: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def make_ort_direct(case: Case, threads: int, compiled):
    """A session on kiln's own blob, kiln's session options, NumPy in, NumPy out."""
    if compiled is None:
        raise RuntimeError("needs the kiln runner, which failed")
    m = compiled.manifest
    parts = m["partitions"]
    steps = m["program"]["steps"]
    if len(parts) != 1 or len(steps) != 1 or "partition" not in steps[0]:
        raise RuntimeError(f"not comparable: the kiln artifact has {len(parts)} partition(s) and "
                           f"{len(steps)} program step(s); direct ORT needs one partition fed by the inputs")
    flat = compiled.flatten(case.args, case.kwargs)
    specs = parts[0]["inputs"]
    if len(specs) != len(flat) or any(list(t.shape) != list(s["shape"]) for t, s in zip(flat, specs)):
        raise RuntimeError("not comparable: the partition's inputs are not the model's inputs")
    blob = compiled._artifact.blobs[parts[0]["blob"]]
    session = ort_session(blob, threads, "ORT_DISABLE_ALL")
    names = [i.name for i in session.get_inputs()]
    feed = {n: np.ascontiguousarray(t.numpy()) for n, t in zip(names, flat)}

    def run():
        return session.run(None, feed)
    return run, {"graph_optimization_level": "ORT_DISABLE_ALL", "intra_op_num_threads": threads,
                 "inter_op_num_threads": 1}


def make_ort_export(case: Case, threads: int):
    with torch.no_grad(), quiet():
        program = torch.onnx.export(case.model, tuple(case.args), kwargs=dict(case.kwargs) or None,
                                    dynamo=True, optimize=True, verbose=False, report=False)
        proto = program.model_proto.SerializeToString()
    session = ort_session(proto, threads, "ORT_ENABLE_ALL")
    names = [i.name for i in session.get_inputs()]
    flat = case.flat_inputs()
    by_name = dict(case.kwargs)
    if all(n in by_name for n in names):
        feed = {n: np.ascontiguousarray(by_name[n].numpy()) for n in names}
    elif len(names) == len(flat):
        feed = {n: np.ascontiguousarray(t.numpy()) for n, t in zip(names, flat)}
    else:
        raise RuntimeError(f"exported model takes inputs {names}, cannot map {len(flat)} model inputs")

    def run():
        return session.run(None, feed)
    return run, {"graph_optimization_level": "ORT_ENABLE_ALL", "intra_op_num_threads": threads,
                 "inter_op_num_threads": 1, "onnx_bytes": len(proto)}


def build_runners(case: Case, threads: int, skip: set, atol: float) -> tuple[list, object]:
    runners = []
    reference = None
    compiled = None
    for key, label in RUNNERS:
        r = Runner(key, label)
        runners.append(r)
        if key in skip:
            r.status, r.note = "skipped", "skipped by --skip"
            continue
        log(f"{case.name}: setting up {label} ...")
        t0 = time.perf_counter()
        try:
            if key == "eager":
                fn, extra = make_eager(case, threads)
            elif key == "torchscript":
                fn, extra = make_torchscript(case, threads)
            elif key == "torch.compile":
                fn, extra = make_torch_compile(case, threads)
            elif key == "kiln":
                fn, extra = make_kiln(case, threads)
                compiled = extra.pop("compiled")
            elif key == "ort-direct":
                fn, extra = make_ort_direct(case, threads, compiled)
            elif key == "ort-export":
                fn, extra = make_ort_export(case, threads)
            else:  # pragma: no cover
                raise AssertionError(key)
            with quiet():
                out = fn()
            r.fn, r.extra = fn, extra
        except Exception as e:  # noqa: BLE001
            r.fail(e, status="skipped" if key in ("torch.compile", "ort-export") else "error")
            if key == "torch.compile":
                r.note = "torch.compile failed; runner skipped"
            elif key == "ort-export":
                r.note = "torch.onnx.export/ORT baseline failed; runner skipped"
            log(f"{case.name}: {label} failed: {r.error}")
            continue
        r.setup_seconds = round(time.perf_counter() - t0, 3)
        if key == "eager":
            reference = out
        elif reference is not None:
            r.max_abs_diff = max_abs_diff(reference, out)
            if r.max_abs_diff is not None and r.max_abs_diff > atol:
                r.note = f"output differs from eager by {r.max_abs_diff:.2e} (> {atol:g})"
        log(f"{case.name}: {label} ready in {r.setup_seconds:.1f}s"
            + (f" (max |diff| vs eager {r.max_abs_diff:.1e})" if r.max_abs_diff is not None else ""))
    return runners, compiled


# ---------------------------------------------------------------------------------------------
# timing

def time_block(fn, n: int, discard: int) -> list:
    for _ in range(discard):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def measure(case: Case, runners: list, args) -> None:
    live = [r for r in runners if r.fn is not None]
    # Warm-up, also estimating the per-call time to size the timed run.
    for r in live:
        try:
            ts = time_block(r.fn, max(args.warmup, 1), 0)
            per_call = statistics.median(ts[len(ts) // 2:])
            if args.iters:
                r.iters = args.iters
            else:
                r.iters = int(min(args.max_iters, max(args.min_iters, math.ceil(args.seconds / per_call))))
            log(f"{case.name}: {r.label}: warm-up {len(ts)} calls, ~{per_call * 1e3:.2f} ms/call, "
                f"timing {r.iters} calls")
        except Exception as e:  # noqa: BLE001
            r.fail(e)
            log(f"{case.name}: {r.label} failed in warm-up: {r.error}")
    live = [r for r in live if r.fn is not None]
    # kiln and ort-direct run the same session and should cost the same: time them equally
    # often and back to back in every round, so the overhead compares like with like.
    pair = [r for r in live if r.key in ("kiln", "ort-direct")]
    if len(pair) == 2 and not args.iters:
        n = max(p.iters for p in pair)
        for p in pair:
            p.iters = n
    rounds = max(1, args.rounds)
    order_rng = random.Random(args.seed)
    case.load_before = background_load()
    warn = load_warning(case.load_before)
    if warn:
        log(f"{case.name}: WARNING: {warn}")
    gc.collect()
    for rnd in range(rounds):
        units = [[r] for r in live if r not in pair or len(pair) != 2]
        if len(pair) == 2:
            units.append(order_rng.sample(pair, 2))
        order_rng.shuffle(units)
        for r in (r for unit in units for r in unit):
            if r.fn is None:
                continue
            n = r.iters // rounds + (1 if rnd < r.iters % rounds else 0)
            if n <= 0:
                continue
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                block = time_block(r.fn, n, args.block_discard)
                r.samples.extend(block)
                r.blocks.append(block)
            except Exception as e:  # noqa: BLE001
                r.fail(e)
                log(f"{case.name}: {r.label} failed while timing: {r.error}")
            finally:
                if gc_was_enabled:
                    gc.enable()
        log(f"{case.name}: round {rnd + 1}/{rounds} done")
    case.load_after = background_load()
    warn = load_warning(case.load_after)
    if warn:
        log(f"{case.name}: WARNING (after timing): {warn}")


# ---------------------------------------------------------------------------------------------
# results

def summarize(case: Case, runners: list, args) -> dict:
    res = {"description": case.description, "inputs": case.input_desc(), "runners": {}}
    eager = next((r for r in runners if r.key == "eager" and r.samples and r.fn is not None), None)
    eager_med = statistics.median(eager.samples) if eager else None
    for r in runners:
        d = {"label": r.label, "status": r.status}
        if r.status == "ok" and r.samples:
            med = statistics.median(r.samples)
            d.update({
                "median_ms": round(med * 1e3, 4),
                "p90_ms": round(pct(r.samples, 90) * 1e3, 4),
                "mean_ms": round(statistics.fmean(r.samples) * 1e3, 4),
                "min_ms": round(min(r.samples) * 1e3, 4),
                "stdev_ms": round(statistics.pstdev(r.samples) * 1e3, 4),
                "iters": len(r.samples),
                "speedup_vs_eager": round(eager_med / med, 3) if eager_med else None,
                "samples_ms": [round(x * 1e3, 4) for x in r.samples],
            })
        elif r.status == "ok":
            d["status"] = "error"
            d["error"] = r.error or "no timed samples"
        if r.error:
            d["error"] = r.error
            if "traceback" in r.extra:
                d["traceback"] = r.extra["traceback"]
        for k in ("setup_seconds", "max_abs_diff", "note"):
            if getattr(r, k) is not None:
                d[k] = getattr(r, k)
        d.update({k: v for k, v in r.extra.items() if k != "traceback"})
        res["runners"][r.key] = d
    rk, ro = res["runners"].get("kiln", {}), res["runners"].get("ort-direct", {})
    speedup = rk.get("speedup_vs_eager")
    overhead = overhead_us = None
    if rk.get("median_ms") and ro.get("median_ms"):
        overhead = round((rk["median_ms"] / ro["median_ms"] - 1) * 100, 3)
        overhead_us = round((rk["median_ms"] - ro["median_ms"]) * 1e3, 1)
    res["kiln_speedup_vs_eager"] = speedup
    res["kiln_overhead_vs_ort_direct_pct"] = overhead
    res["kiln_overhead_vs_ort_direct_us"] = overhead_us
    # Second estimate, robust to the machine's speed drifting between rounds: the median over
    # rounds of (kiln block median / ort-direct block median), the two blocks run back to back.
    rkr = next((r for r in runners if r.key == "kiln"), None)
    ror = next((r for r in runners if r.key == "ort-direct"), None)
    paired = None
    if overhead is not None and rkr and ror and len(rkr.blocks) == len(ror.blocks) and rkr.blocks:
        ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(rkr.blocks, ror.blocks) if a and b]
        if ratios:
            paired = round((statistics.median(ratios) - 1) * 100, 3)
    res["kiln_overhead_vs_ort_direct_paired_pct"] = paired
    res["background_load"] = {"before_timing": case.load_before, "after_timing": case.load_after}
    warns = [w for w in (load_warning(case.load_before or {}), load_warning(case.load_after or {})) if w]
    if warns:
        res["warning"] = warns[0]
    res["kiln_compile_seconds"] = rk.get("compile_seconds")
    kiln_failed = rk.get("status") != "ok"  # kiln itself failing misses both targets
    res["targets"] = {
        "kiln_speedup_vs_eager": {
            "target": f">= {TARGET_SPEEDUP}x", "value": speedup,
            "pass": (False if kiln_failed else None) if speedup is None else speedup >= TARGET_SPEEDUP},
        "kiln_overhead_vs_ort_direct_pct": {
            "target": f"<= {TARGET_OVERHEAD_PCT}%", "value": overhead,
            "pass": (False if kiln_failed else None) if overhead is None else overhead <= TARGET_OVERHEAD_PCT},
    }
    return res


def fmt_ms(v):
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.2f}")


def pass_text(p):
    return {True: "PASS", False: "FAIL", None: "n/a"}[p]


def render(results: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table
    m = results["machine"]
    console.print(f"\n[bold]kiln latency benchmark[/bold]  {m['cpu_model']}, {m['cpus_in_affinity']} CPU(s) in "
                  f"affinity, {m['threads_used']} thread(s); torch {m['torch']}, onnxruntime {m['onnxruntime']}"
                  + ("  [yellow](--quick: tiny configs)[/yellow]" if results["settings"]["quick"] else ""))
    for name, res in results["models"].items():
        t = Table(title=f"{name}: {res['description']}", title_justify="left", show_lines=False)
        t.add_column("runner", no_wrap=True)
        t.add_column("median ms", justify="right")
        t.add_column("p90 ms", justify="right")
        t.add_column("vs eager", justify="right")
        t.add_column("n", justify="right")
        t.add_column("setup s", justify="right")
        t.add_column("max|diff|", justify="right")
        t.add_column("note", overflow="fold", max_width=60)
        for d in res["runners"].values():
            if "median_ms" in d:
                sp = d.get("speedup_vs_eager")
                t.add_row(d["label"], fmt_ms(d["median_ms"]), fmt_ms(d["p90_ms"]),
                          "-" if sp is None else f"{sp:.2f}x", str(d["iters"]),
                          "-" if d.get("setup_seconds") is None else f"{d['setup_seconds']:.1f}",
                          "-" if d.get("max_abs_diff") is None else f"{d['max_abs_diff']:.1e}",
                          escape(d.get("note") or ""))
            else:
                what = escape(d.get("error") or d.get("note") or d["status"])
                prefix = "skipped" if d["status"] == "skipped" else "error"
                t.add_row(d["label"], "-", "-", "-", "-", "-", "-",
                          f"[red]{prefix}: {what}[/red]" if prefix == "error" else f"{prefix}: {what}")
        console.print(t)
        tg = res.get("targets") or {}
        sp = tg.get("kiln_speedup_vs_eager") or {"value": None, "target": f">= {TARGET_SPEEDUP}x", "pass": None}
        ov = tg.get("kiln_overhead_vs_ort_direct_pct") or {"value": None, "target": f"<= {TARGET_OVERHEAD_PCT}%",
                                                           "pass": None}
        comp = res.get("kiln_compile_seconds")
        comp_s = "-" if comp is None else f"{comp:.1f} s"
        sp_s = "-" if sp["value"] is None else f"{sp['value']:.2f}x"
        ov_s = "-" if ov["value"] is None else f"{ov['value']:+.2f}%"
        if res.get("kiln_overhead_vs_ort_direct_us") is not None:
            ov_s += f" ({res['kiln_overhead_vs_ort_direct_us']:+.0f} us/call"
            if res.get("kiln_overhead_vs_ort_direct_paired_pct") is not None:
                ov_s += f"; per-round paired: {res['kiln_overhead_vs_ort_direct_paired_pct']:+.2f}%"
            ov_s += ")"
        console.print(f"  kiln compile time:              {comp_s}")
        console.print(f"  kiln speedup vs eager:          {sp_s}  (target {sp['target']}: {pass_text(sp['pass'])})")
        console.print(f"  kiln overhead over ORT direct:  {ov_s}  (target {ov['target']}: {pass_text(ov['pass'])})")
        if res.get("error"):
            console.print(f"  [red]error: {escape(res['error'])}[/red]")
        if res.get("warning"):
            console.print(f"  [yellow]warning: {escape(res['warning'])}[/yellow]")
    s = results["summary"]
    console.print(f"\nall targets: {pass_text(s['all_targets_pass'])}   JSON: {results['json_path']}\n")


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per runner (default: sized so each runner is timed ~--seconds)")
    p.add_argument("--seconds", type=float, default=None,
                   help="timed seconds per runner when --iters is not given (default 5; 0.5 with --quick)")
    p.add_argument("--min-iters", type=int, default=30, help="fewest timed calls per runner (default 30)")
    p.add_argument("--max-iters", type=int, default=2000, help="most timed calls per runner (default 2000)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per runner (default 10; 3 with --quick)")
    p.add_argument("--rounds", type=int, default=10,
                   help="timed calls are interleaved across runners in this many rounds (default 10)")
    p.add_argument("--block-discard", type=int, default=1,
                   help="calls discarded at the start of each runner's block in a round (default 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and ONNX Runtime (default: CPUs in this process's affinity)")
    p.add_argument("--skip", default="", help=f"comma-separated runners to skip, from {', '.join(LABELS)}")
    p.add_argument("--quick", action="store_true", help="tiny model configs, few iterations: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=1e-3, help="output check tolerance vs eager (note only)")
    p.add_argument("--json", default=None,
                   help="where to write results (default benchmarks/results/latency.json, "
                        "latency-quick.json with --quick)")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 if a kiln target is missed")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 3 if args.quick else 10
    if args.seconds is None:
        args.seconds = 0.5 if args.quick else 5.0
    if args.json is None:
        args.json = str(HERE / "results" / ("latency-quick.json" if args.quick else "latency.json"))
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.model_list:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    args.skip_set = {s.strip() for s in args.skip.split(",") if s.strip()}
    for s in args.skip_set:
        if s not in LABELS:
            p.error(f"unknown runner {s!r}; choose from {', '.join(LABELS)}")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from rich.console import Console
    console = Console(width=None if sys.stdout.isatty() else 160)

    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    seed_everything(args.seed)
    results = {
        "benchmark": "latency",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "settings": {"models": args.model_list, "iters": args.iters, "seconds_per_runner": args.seconds,
                     "warmup": args.warmup, "rounds": args.rounds, "block_discard": args.block_discard,
                     "threads": threads, "seed": args.seed, "quick": args.quick, "batch": 1, "dtype": "float32",
                     "skip": sorted(args.skip_set)},
        "machine": machine_info(threads),
        "targets": {"kiln_speedup_vs_eager_min": TARGET_SPEEDUP,
                    "kiln_overhead_vs_ort_direct_max_pct": TARGET_OVERHEAD_PCT},
        "runners": LABELS,
        "models": {},
        "json_path": display_path(args.json),
    }
    for name in args.model_list:
        try:
            case = build_case(name, args.quick, args.seed)
        except Exception as e:  # noqa: BLE001
            log(f"{name}: could not build the model: {short_error(e)}")
            results["models"][name] = {"description": name, "error": short_error(e), "runners": {},
                                       "targets": {}}
            continue
        log(f"{name}: {case.description}")
        runners, compiled = build_runners(case, threads, args.skip_set, args.atol)
        measure(case, runners, args)
        results["models"][name] = summarize(case, runners, args)
        del runners, compiled, case
        gc.collect()

    passes = [t["pass"] for res in results["models"].values() for t in res.get("targets", {}).values()]
    if any(p is False for p in passes):
        all_pass = False
    elif passes and all(p is True for p in passes):
        all_pass = True
    else:
        all_pass = None  # a target could not be measured
    results["summary"] = {
        "all_targets_pass": all_pass,
        "per_model": {n: {k: t["pass"] for k, t in res.get("targets", {}).items()}
                      for n, res in results["models"].items()},
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, out)
    render(results, console)
    if args.fail_on_miss and results["summary"]["all_targets_pass"] is not True:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
