"""kiln on an NVIDIA GPU against its peers there, in one run: table + JSON.

    python benchmarks/gpu.py [--models bert-base,resnet50] [--batches 1,8] [--rounds 5]
                             [--skip RUNNER,...] [--after FILE] [--json PATH]

Runners, all fed inputs already on the GPU (kiln returns outputs on the
device its inputs came from), timed with torch.cuda.synchronize() around
each call, interleaved in rounds, median reported:

* ``eager``            the model in PyTorch on the GPU, fp32
* ``torch.compile``    inductor, default mode
* ``reduce-overhead``  ``torch.compile(mode="reduce-overhead")``: inductor with CUDA graphs;
                       its outputs are cloned after each call, as kiln's are (the graph
                       overwrites them at the next call)
* ``aotinductor``      torch.export + aoti_compile_and_package + aoti_load_package
* ``kiln``             kiln.trace(device="cuda"), -O2 (TorchInductor), each call replayed as
                       a captured CUDA graph (kiln.runtime.cuda_graphs)
* ``kiln-uncaptured``  the same artifact with ``RuntimeOptions(cuda_graphs=False)``: every
                       kernel launched by AOTInductor's runtime (no second compile)
* ``kiln-O3``          kiln.trace(..., optlevel=3): inductor's default and ``frozen``
                       builds timed, the fastest kept; graphed
* ``kiln-bf16``        --auto-cast matmult --auto-cast-type bf16 (skipped unless asked for
                       with ``--skip ''``)

``--after FILE`` compiles everything, then waits for FILE to exist before timing: a job
sharing the machine (a test run) stays out of the numbers. Needs a CUDA device; exits 2
with a message otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import build_case, cosine, flat_tensors, short_error  # noqa: E402


def on_gpu(case, batch=1):
    """The case on the GPU, its inputs repeated to ``batch`` rows."""
    def rows(t):
        return t.repeat(batch, *[1] * (t.dim() - 1)).cuda()
    case.model = case.model.cuda()
    case.args = tuple(rows(a) for a in case.args)
    case.kwargs = {k: rows(v) for k, v in case.kwargs.items()}
    return case


def _cloned(out):
    return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def runners(case, skip):
    """``(makers, built)``: each runner's maker by name, and the kiln models the makers
    built (``built["kiln"]``, once made), which the table reads the CUDA-graph state of."""
    import kiln
    m, args, kwargs = case.model, case.args, case.kwargs
    out = {}

    def eager():
        with torch.inference_mode():
            return m(*args, **kwargs)
    out["eager"] = lambda: eager
    if "torch.compile" not in skip:
        def compiled():
            c = torch.compile(m)
            def run():
                with torch.inference_mode():
                    return c(*args, **kwargs)
            return run
        out["torch.compile"] = compiled
    if "reduce-overhead" not in skip:
        def overhead():
            c = torch.compile(m, mode="reduce-overhead")
            def run():
                with torch.inference_mode():
                    return _cloned(c(*args, **kwargs))
            return run
        out["reduce-overhead"] = overhead
    if "aotinductor" not in skip:
        def aoti():
            with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
                ep = torch.export.export(m, args, kwargs)
                path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "m.pt2"))
                r = torch._inductor.aoti_load_package(path)
            return lambda: r(*args, **kwargs)
        out["aotinductor"] = aoti
    built = {}
    if "kiln" not in skip:
        def k():
            c = built["kiln"] = kiln.trace(m, args or None, kwargs or None, device="cuda", cache=False,
                                           quiet=True)
            return lambda: c(*args, **kwargs)
        out["kiln"] = k
        if "kiln-uncaptured" not in skip:
            def ku():
                from kiln.runtime.model import CompiledModel
                from kiln.runtime.options import RuntimeOptions
                if "kiln" not in built:
                    raise RuntimeError("needs the kiln runner's artifact, which did not build")
                c = CompiledModel(built["kiln"]._artifact, RuntimeOptions(cuda_graphs=False))
                return lambda: c(*args, **kwargs)
            out["kiln-uncaptured"] = ku
    if "kiln-O3" not in skip:
        def k3():
            c = kiln.trace(m, args or None, kwargs or None, device="cuda", cache=False, quiet=True, optlevel=3)
            print(f"  kiln-O3 variants: {[p.get('variant') for p in c.manifest['partitions']]}",
                  file=sys.stderr, flush=True)
            return lambda: c(*args, **kwargs)
        out["kiln-O3"] = k3
    if "kiln-bf16" not in skip:
        def kb():
            c = kiln.trace(m, args or None, kwargs or None, device="cuda", cache=False, quiet=True,
                           compiler_args="--auto-cast matmult --auto-cast-type bf16", min_top1=0.0)
            return lambda: c(*args, **kwargs)
        out["kiln-bf16"] = kb
    return out, built


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run_case(name, batch, rounds, per_round, skip, after=None):
    case = on_gpu(build_case(name, False, 0), batch)
    built, results = {}, {}
    makers, kiln_models = runners(case, skip)
    for key, make in makers.items():
        t0 = time.perf_counter()
        try:
            built[key] = make()
            ref = built[key]()
            results[key] = {"setup_seconds": round(time.perf_counter() - t0, 2), "samples": []}
            results[key]["_out"] = [t.float().cpu() for t in flat_tensors(ref)]
        except Exception as e:  # a peer that cannot build is reported, not fatal
            results[key] = {"status": "error", "error": short_error(e)}
            built.pop(key, None)
        print(f"  {name}: {key} ready", file=sys.stderr, flush=True)
    if after:
        print(f"  {name}: compiled; waiting for {after} before timing", file=sys.stderr, flush=True)
        while not os.path.exists(after):
            time.sleep(1)
    for fn in built.values():
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for key, fn in built.items():
            fn()
            results[key]["samples"] += [timed(fn) for _ in range(per_round)]
    if "kiln" in kiln_models and "samples" in results.get("kiln", {}):
        graph = kiln_models["kiln"].cuda_graph
        results["kiln"]["cuda_graph"] = graph.state if graph is not None else "off"
    ref = results["eager"]["_out"]
    base = statistics.median(results["eager"]["samples"])
    aoti = results.get("aotinductor", {}).get("samples")
    aoti = statistics.median(aoti) if aoti else None
    for key, r in results.items():
        if "samples" in r:
            r["median_ms"] = round(statistics.median(r["samples"]), 4)
            r["vs_eager"] = round(base / r["median_ms"], 3)
            if aoti:
                r["latency_vs_aotinductor"] = round(r["median_ms"] / aoti, 3)
            r["cosine_vs_eager"] = cosine(ref, r.pop("_out"))
            del r["samples"]
    return {"model": case.description, "batch": batch, "runners": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert-base,resnet50")
    p.add_argument("--batches", default="1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--skip", default="kiln-bf16")
    p.add_argument("--after", default=None, help="wait for this file to exist before timing")
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "gpu.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    skip = set(filter(None, a.skip.split(",")))
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    rows = []
    for name in a.models.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            res = out["cases"][f"{name}-b{batch}"] = run_case(name, batch, a.rounds, a.per_round, skip, a.after)
            with open(a.json, "w") as f:   # after each case: a later failure keeps what was measured
                json.dump(out, f, indent=1)
            rows += [(name, batch, key, r) for key, r in res["runners"].items()]
    print(f"\n{out['device']}, torch {out['torch']}, median of {a.rounds}x{a.per_round} calls")
    print(f"{'model':<10} {'batch':>5} {'runner':<16} {'ms':>9} {'vs eager':>9} {'/ AOTI':>7} {'cosine':>10}")
    for name, batch, key, r in rows:
        if "median_ms" in r:
            vs = r.get("latency_vs_aotinductor")
            print(f"{name:<10} {batch:>5} {key:<16} {r['median_ms']:>9.3f} {r['vs_eager']:>8.2f}x "
                  f"{(f'{vs:.2f}' if vs else '-'):>7} {(r['cosine_vs_eager'] or float('nan')):>10.6f} {r.get('cuda_graph', '')}")
        else:
            print(f"{name:<10} {batch:>5} {key:<16} {'error':>9}  {r['error'][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
