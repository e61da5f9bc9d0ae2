#!/usr/bin/env python
"""Training-step throughput: kiln's device and torch.compile backend against PyTorch.

Models (random weights, nothing downloaded):

* ``bert`` - ``BertForSequenceClassification`` with 4 layers, hidden 256, 4 heads,
  intermediate 1024, vocabulary 8192; batch 8, sequence 128; dropout on (0.1)
* ``cnn``  - a small CNN (three conv + batch-norm + ReLU blocks, 32 -> 64 -> 64 channels,
  global pooling, a linear head); batch 32, 3x32x32
* ``gpt2`` - ``GPT2LMHeadModel`` with 2 layers, hidden 128, 4 heads, vocabulary 1000, context
  128; batch 8, sequence 64, its own language-modelling loss (dropout off). Not in ``all``:
  until 12-03 its step ran op by op on the device (docs/device.md)

Runners, all in one process, each on its own copy of the same weights, the same batches,
AdamW (lr 1e-4), in fp32 and under bf16 autocast:

* ``eager``          PyTorch eager on the CPU (the baseline of every ratio)
* ``inductor``       ``torch.compile(model)`` (default mode)
* ``kiln-compile``   ``torch.compile(model, backend="kiln")``
* ``kiln-lazy``      the model on ``torch.device("kiln")`` in lazy mode, ``mark_step()`` per step
* ``kiln-eager``     the model on ``torch.device("kiln")`` in eager mode (adaptive fusion)
* ``eager-keep``, ``inductor-keep``  eager and Inductor with the malloc settings kiln applies when
  it loads a compiled model (:mod:`kiln.host.memory`: freed memory kept mapped, not faulted
  back in on every step), so that what those settings alone give is a row of its own
* ``torch-xla``      torch_xla's lazy mode on the CPU (``PJRT_DEVICE=CPU``), ``xm.mark_step()`` per
  step: the system kiln's lazy mode imitates. torch_xla pairs with its own torch (2.9), so
  it runs in another interpreter: ``--torch-xla-python`` (or ``TORCH_XLA_PYTHON``) names
  one whose environment has ``torch-xla`` and ``transformers``; without one the row says
  it was not run. Its dropout draws from XLA's generator, so its losses differ from
  eager's as Inductor's do.

Each runner runs in a process of its own (engine thread pools and compiled programs of
one runner must not slow the next), trains ``--warmup`` steps (compiles happen there), then
``--steps`` timed steps, each ending when its loss is on the host. Reported: steps/s (of the
median step), the ratio to eager and to Inductor, the best step and its ratio to eager's best
(steadier on a loaded machine), the first step's time, compiles after warm-up, the warm-up
time, the largest difference of the timed losses from eager's (every runner starts from the
same weights and data, and dropout draws from the same seeded generator, so the losses
follow eager's), and the minor page faults of a timed step (thousands where glibc hands a
step's buffers back to the kernel: they explained steps 1.6x slower than the same program's
in another process).

    python benchmarks/train.py                  # both models, fp32 and bf16
    python benchmarks/train.py --model bert --precision fp32 --steps 5
    python benchmarks/train.py --precision fp32 --rounds 3   # each runner 3 times, ratios paired by round
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RUNNERS = ("eager", "inductor", "eager-keep", "inductor-keep", "kiln-compile", "kiln-lazy", "kiln-eager",
           "kiln-lazy-overlap", "torch-xla")
TARGETS = {"kiln-lazy": ("eager", 1.3, "inductor", 1.0), "kiln-compile": ("eager", 1.3, "inductor", 1.0),
           "kiln-eager": ("eager", 0.9, None, None), "kiln-lazy vs torch-xla": ("torch-xla", 1.0, None, None)}


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()

        def block(i, o, s):
            return nn.Sequential(nn.Conv2d(i, o, 3, stride=s, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.features = nn.Sequential(block(3, 32, 1), block(32, 64, 2), block(64, 64, 2))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def make_case(name: str):
    """(model, batches: list of (inputs dict, labels), loss(model, inputs, labels))."""
    g = torch.Generator().manual_seed(0)
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification
        cfg = BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=1024, max_position_embeddings=128, num_labels=2)
        torch.manual_seed(0)
        model = BertForSequenceClassification(cfg)
        batches = [({"input_ids": torch.randint(0, 8192, (8, 128), generator=g)},
                    torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]

        def loss(m, inputs, labels):
            return F.cross_entropy(m(**inputs).logits.float(), labels)
        return model, batches, loss
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=128,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        ids = [torch.randint(0, 1000, (8, 64), generator=g) for _ in range(4)]
        batches = [({"input_ids": t}, t.clone()) for t in ids]

        def loss(m, inputs, labels):
            return m(input_ids=inputs["input_ids"], labels=labels).loss.float()
        return model, batches, loss
    torch.manual_seed(0)
    model = SmallCNN()
    batches = [({"x": torch.randn(32, 3, 32, 32, generator=g)}, torch.randint(0, 10, (32,), generator=g))
               for _ in range(4)]

    def loss(m, inputs, labels):
        return F.cross_entropy(m(inputs["x"]).float(), labels)
    return model, batches, loss


def _compile_count(kind):
    if kind.startswith("kiln"):
        from kiln.device import metrics
        return metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile")
    if kind == "inductor":
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]
    return 0


def run(kind, case, precision, warmup, steps):
    model, batches, loss_fn = case
    if kind.endswith("-keep"):
        from kiln.host import memory
        if not memory.keep_freed_memory()["applied"]:
            raise RuntimeError(f"kiln's malloc settings were not applied: {memory.state()['reason']}")
        kind = kind.removesuffix("-keep")
    model = copy.deepcopy(model).train()
    device = torch.device("cpu")
    overlap = kind == "kiln-lazy-overlap"
    if overlap:       # a step's program runs while the next is recorded; losses read at the end
        kind = "kiln-lazy"
    if kind in ("kiln-lazy", "kiln-eager"):
        from kiln.device import modes
        device = modes.device()
        modes.set_mode(kind.split("-")[1], overlap=overlap)
        model = model.to(device)
    runner = model
    if kind == "inductor":
        torch._dynamo.reset()
        runner = torch.compile(model)
    elif kind == "kiln-compile":
        torch._dynamo.reset()
        runner = torch.compile(model, backend="kiln", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(123)                     # dropout's draws: the same for every runner

    def step(i):
        inputs, labels = batches[i % len(batches)]
        inputs = {k: v.to(device) for k, v in inputs.items()}
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(runner, inputs, labels.to(device))
        loss.backward()
        opt.step()
        if kind == "kiln-lazy":
            from kiln.device import modes
            modes.mark_step()
        return loss.detach() if overlap else float(loss)
    return _timed(step, warmup, steps, lambda: _compile_count(kind),
                  kind in ("kiln-lazy", "kiln-eager"))


def _timed(step, warmup, steps, compiles, kiln_device=False) -> dict:
    """``warmup`` steps (the first timed alone), then ``steps`` timed ones."""
    started = time.perf_counter()
    losses = [step(0)]
    first = time.perf_counter() - started
    losses += [step(i) for i in range(1, warmup)]
    marks, start = {}, warmup
    if kiln_device:                       # programs compile in the background: timed steps run them
        more = _until_compiled(step, warmup, started, marks)
        losses += more
        start += len(more)
    warm = time.perf_counter() - started
    before = compiles()
    faults = _minor_faults()
    times = []
    # the steps go on from where the warm-up stopped: step i is the same batch, the same model
    # state and the same dropout draws in every runner, so the losses compare step by step
    for i in range(start, start + steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    faults = (_minor_faults() - faults) / steps
    losses = [float(v) for v in losses]       # the overlapping runner's, read only now
    times.sort()
    median = times[len(times) // 2]
    return {"steps_per_s": 1.0 / median, "median_step_ms": median * 1e3, "best_step_ms": times[0] * 1e3,
            "warmup_s": warm, "first_step_s": first, **marks,
            "compiles_after_warmup": compiles() - before, "page_faults_per_step": faults, "losses": losses}


KEEP_STEPPING = False       # --keep-stepping: set in the runner's process


def _until_compiled(step, i, started, marks, limit=1800.0) -> list:
    """Wait for the device's background compiles, step, and again, until a step runs compiled
    and asks for nothing more: ``compiled_after_s`` is the end of the first step run compiled
    (its partitions), ``whole_after_s`` of the first run whole, where a program was split
    and then built whole (seconds from the first step's start). The compiles have the machine
    to themselves, as they had before 11-28 (``warmup_s``); a user who goes on stepping meanwhile
    shares the cores with them, and ``--keep-stepping`` measures that: the steps go on, op by
    op, while the programs compile (docs/device.md: 48 s to a compiled BERT-4L step, 198 s
    before the compile process's threads yielded)."""
    from kiln.device import metrics, modes, programs
    losses, idle = [], 0
    while time.perf_counter() - started < limit:
        if not KEEP_STEPPING:
            modes.wait_compiles()
        losses.append(step(i))
        i += 1
        now = time.perf_counter() - started
        if metrics.counter_value("SwappedIn"):
            marks.setdefault("compiled_after_s", now)
        if metrics.counter_value("UpgradedIn"):
            marks.setdefault("whole_after_s", now)
        # done when a step finds nothing compiling (or a compile failed) and no build due
        # twice in a row: a compile that ended during the last step is taken up by the next,
        # which may ask for another (the whole graph; Inductor after some runs on eager's
        # kernels: kiln.device.graphs.later_build)
        idle = idle + 1 if modes.wait_compiles(timeout=0) and not programs.build_due() else 0
        if idle == 2:
            break
    marks["steps_to_compiled"] = i
    return losses


def _minor_faults() -> int:
    """The process's minor page faults so far: pages malloc handed back to the kernel and a
    step touched again (kiln.host.memory); 0 where getrusage is missing."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def run_torch_xla(case, precision, warmup, steps):
    """The step of :func:`run` in torch_xla's lazy mode on the CPU, in an interpreter whose
    torch is torch_xla's (see the module's docstring)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    model, batches, loss_fn = case
    device = torch_xla.device()
    model = copy.deepcopy(model).train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(123)

    def compiles():
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    def step(i):
        inputs, labels = batches[i % len(batches)]
        inputs = {k: v.to(device) for k, v in inputs.items()}
        opt.zero_grad()
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model, inputs, labels.to(device))
        loss.backward()
        opt.step()
        xm.mark_step()
        return float(loss)
    return _timed(step, warmup, steps, compiles)


def recording_cost(n: int = 2000) -> dict:
    """What recording one operation on the device costs, in microseconds: ``n`` additions
    of two 64x64 tensors recorded in lazy mode, against the same additions run by CPU
    eager. Part of every kiln-lazy and kiln-eager step time above (a BERT step records
    about 800 operations). ``kiln_record_us`` is a step recorded again (replayed: it
    matches the last one), ``kiln_record_fresh_us`` one recorded from scratch.
    ``kiln_record_linear_us``: a linear layer's call (``F.linear(x, w)``: the weight's
    ``t()``, a view of host data, and the product), replayed, against CPU eager's
    (``cpu_eager_linear_us``): a transformer's most common call."""
    from kiln.device import modes
    dev = modes.device()
    out = {}
    for key, replay in (("kiln_record_fresh_us", False), ("kiln_record_us", True)):
        modes.set_mode("lazy", compile_after=10 ** 9, replay=replay)   # flushes interpret: nothing compiles
        out.update(_chain_cost(dev, n, key))
    out.update(_chain_cost(dev, n, "kiln_record_linear_us", linear=True))
    return out


def _chain_cost(dev, n, key, linear=False) -> dict:
    from kiln.device import modes

    def chain(x, y):
        for _ in range(n):
            x = F.linear(x, y) if linear else x + y
        return x
    a, b = torch.randn(64, 64), torch.randn(64, 64) / 8
    da, db = a.to(dev), b.to(dev)
    out = {}
    for name, (x, y) in ((key, (da, db)), ("cpu_eager_linear_us" if linear else "cpu_eager_us", (a, b))):
        times = []
        for _ in range(6):
            start = time.perf_counter()
            chain(x, y)
            times.append((time.perf_counter() - start) / n * 1e6)
            modes.mark_step()
        out[name] = sorted(times[1:])[2]           # the first is recorded afresh either way
    return out


def summarize(results):
    for key, res in results.items():
        if "error" in res or "skipped" in res or key.count("/") != 2:
            continue
        base = results.get(key.rsplit("/", 1)[0] + "/eager", {})
        ind = results.get(key.rsplit("/", 1)[0] + "/inductor", {})
        if "steps_per_s" in base:
            res["vs_eager"] = res["steps_per_s"] / base["steps_per_s"]
            res["best_vs_eager"] = base["best_step_ms"] / res["best_step_ms"]
            res["loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(res["losses"], base["losses"]))
        if "steps_per_s" in ind:
            res["vs_inductor"] = res["steps_per_s"] / ind["steps_per_s"]
        kept = results.get(key.rsplit("/", 1)[0] + "/eager-keep", {})
        if "steps_per_s" in kept and key.split("/")[2].startswith("kiln-"):
            res["vs_eager_keep"] = res["steps_per_s"] / kept["steps_per_s"]
        xla = results.get(key.rsplit("/", 1)[0] + "/torch-xla", {})
        if "steps_per_s" in xla and key.split("/")[2].startswith("kiln-"):
            res["vs_torch_xla"] = res["steps_per_s"] / xla["steps_per_s"]


def table(results):
    head = f"{'case':<28}{'steps/s':>9}{'ms/step':>9}{'x eager':>9}{'x induct':>9}{'best ms':>9}{'x eager':>9}" \
           f"{'compiles':>9}{'first s':>9}{'warmup s':>10}{'loss diff':>11}{'faults':>9}"
    lines = [head, "-" * len(head)]
    for key, res in results.items():
        if "error" in res or "skipped" in res:
            lines.append(f"{key:<28} {'error' if 'error' in res else 'not run'}: "
                         f"{res.get('error', res.get('skipped'))[:90]}")
            continue
        lines.append(f"{key:<28}{res['steps_per_s']:>9.2f}{res['median_step_ms']:>9.1f}"
                     f"{res.get('vs_eager', float('nan')):>9.2f}{res.get('vs_inductor', float('nan')):>9.2f}"
                     f"{res['best_step_ms']:>9.1f}{res.get('best_vs_eager', float('nan')):>9.2f}"
                     f"{res['compiles_after_warmup']:>9}{res.get('first_step_s', float('nan')):>9.1f}"
                     f"{res['warmup_s']:>10.1f}"
                     f"{res.get('loss_diff_vs_eager', float('nan')):>11.2e}"
                     f"{res.get('page_faults_per_step', float('nan')):>9.0f}")
    lines += [f"{key:<28}{res['vs_eager_keep']:>9.2f} x eager with kiln's malloc settings"
              for key, res in results.items() if "vs_eager_keep" in res]
    lines += [f"{key:<28}{res['vs_torch_xla']:>9.2f} x torch_xla's lazy mode" for key, res in results.items()
              if "vs_torch_xla" in res]
    lines += [f"{key:<28} a step ran compiled {res['compiled_after_s']:.1f} s after the first began"
              + (f", whole-graph {res['whole_after_s']:.1f} s" if "whole_after_s" in res else "")
              for key, res in results.items() if "compiled_after_s" in res]
    return "\n".join(lines)


def torch_xla_python(given) -> str | None:
    """The interpreter to run torch_xla in: ``given``, ``TORCH_XLA_PYTHON``, or this one
    where it imports torch_xla; None where there is none."""
    import importlib.util
    given = given or os.environ.get("TORCH_XLA_PYTHON")
    if given:
        return given
    return sys.executable if importlib.util.find_spec("torch_xla") is not None else None


def merge_rounds(rounds: list) -> dict:
    """One result per runner from several rounds: the round with the median steps/s (its
    step times, losses and marks), the first round's first-step and warm-up times (later
    rounds find the compile cache warm), and every round's steps/s and ratio to the eager
    runner of the same round (``x_eager_by_round``: paired, so the machine's drift between
    rounds cancels)."""
    if len(rounds) == 1:
        return rounds[0]
    merged = {}
    for key in rounds[0]:
        runs = [r[key] for r in rounds if "steps_per_s" in r.get(key, {})]
        if not runs:
            merged[key] = rounds[0][key]
            continue
        pick = sorted(runs, key=lambda x: x["steps_per_s"])[len(runs) // 2]
        eager_key = key.rsplit("/", 1)[0] + "/eager"
        paired = [r[key]["steps_per_s"] / r[eager_key]["steps_per_s"] for r in rounds
                  if "steps_per_s" in r.get(key, {}) and "steps_per_s" in r.get(eager_key, {})]
        merged[key] = {**pick, "first_step_s": runs[0].get("first_step_s"), "warmup_s": runs[0].get("warmup_s"),
                       "steps_per_s_by_round": [x["steps_per_s"] for x in runs],
                       "x_eager_by_round": paired,
                       "x_eager_median_of_rounds": statistics.median(paired) if paired else None}
    summarize(merged)
    return merged


def rounds_table(results: dict) -> str:
    lines = ["runner                        x eager, round by round (paired)        median"]
    for key, res in results.items():
        paired = res.get("x_eager_by_round")
        if paired and not key.endswith("/eager"):
            lines.append(f"{key:28s}  {' '.join(f'{x:5.2f}' for x in paired):40s} {res['x_eager_median_of_rounds']:5.2f}")
    return "\n".join(lines)


def _in_child(key, args) -> dict:
    import subprocess
    import tempfile
    python, env = sys.executable, dict(os.environ)
    if key.endswith("/torch-xla"):
        python = torch_xla_python(args.torch_xla_python)
        if python is None:
            return {"skipped": "torch_xla is not installed: give --torch-xla-python, an interpreter of an "
                               "environment with torch-xla and transformers (pip install 'torch-xla==2.9.*' "
                               "'torch==2.9.*' transformers)"}
        env["PJRT_DEVICE"] = "CPU"
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"    # that torch must not look for kiln's device
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, os.path.abspath(__file__), "--one", key, "--json", out.name,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--threads", str(args.threads)]
        if args.keep_stepping:
            cmd.append("--keep-stepping")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["exit code %d" % proc.returncode]
            return {"error": tail[0]}
        with open(out.name) as f:
            return json.load(f)


def _child(args) -> int:
    global KEEP_STEPPING
    KEEP_STEPPING = args.keep_stepping
    warnings.simplefilter("ignore")
    if not args.one.endswith("/torch-xla"):       # torch_xla's interpreter has no kiln
        from kiln.device import modes
        modes.device()          # before any backward pass: autograd sizes its device queues once
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        if args.one == "recording-cost":
            result = recording_cost()
        else:
            name, precision, kind = args.one.split("/")
            runner = run_torch_xla if kind == "torch-xla" else functools.partial(run, kind)
            result = runner(make_case(name), precision, args.warmup, args.steps)
            result["torch"] = torch.__version__
    except Exception as e:             # a runner that fails is reported, not fatal
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("bert", "cnn", "gpt2", "all"), default="all")
    p.add_argument("--precision", choices=("fp32", "bf16", "all"), default="all")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per runner (default: every CPU; 1 is steadier on a loaded machine)")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "train.json"))
    p.add_argument("--torch-xla-python", help="an interpreter whose environment has torch-xla and transformers "
                                              "(default: TORCH_XLA_PYTHON, or this one if it has torch_xla)")
    p.add_argument("--keep-stepping", action="store_true",
                   help="kiln's device runners step on while their programs compile, as a training "
                        "loop does, instead of waiting for each compile (the compiles then share the cores)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every runner this many times, in turn (eager, the others, eager, ...), and "
                        "report each runner's median round and its ratio to eager round by round: on a "
                        "machine whose speed drifts, paired ratios hold where single runs move by 15%%")
    p.add_argument("--one", help=argparse.SUPPRESS)     # model/precision/runner, in a child process
    args = p.parse_args(argv)
    if args.one:
        return _child(args)
    models = ("bert", "cnn") if args.model == "all" else (args.model,)
    precisions = ("fp32", "bf16") if args.precision == "all" else (args.precision,)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for name in models:
            for precision in precisions:
                for kind in args.runners.split(","):
                    key = f"{name}/{precision}/{kind}"
                    print(f"[train] round {r + 1}/{args.rounds} {key} ...", file=sys.stderr, flush=True)
                    results[key] = _in_child(key, args)
                    print(f"[train] {key}: "
                          f"{results[key].get('steps_per_s', results[key].get('error', results[key].get('skipped')))}",
                          file=sys.stderr, flush=True)
        summarize(results)
        rounds.append(results)
    results = merge_rounds(rounds)
    print(table(results))
    if args.rounds > 1:
        print(rounds_table(results))
    if any(k.startswith("kiln-") for k in args.runners.split(",")):
        cost = results["recording-cost"] = _in_child("recording-cost", args)
        if "error" not in cost:
            print(f"recording one operation on the device: {cost['kiln_record_us']:.1f} us replayed, "
                  f"{cost['kiln_record_fresh_us']:.1f} us afresh (CPU eager runs it in {cost['cpu_eager_us']:.1f} us); "
                  f"a linear layer's call {cost['kiln_record_linear_us']:.1f} us replayed "
                  f"(CPU eager {cost['cpu_eager_linear_us']:.1f} us)")
    info = {"machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "targets": TARGETS}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
