"""kiln on an NVIDIA GPU against its peers there, in one run: table + JSON.

    python benchmarks/gpu.py [--models bert-base,resnet50] [--rounds 5] [--json PATH]

Runners, all fed inputs already on the GPU (kiln returns outputs on the
device its inputs came from), timed with torch.cuda.synchronize() around
each call, interleaved in rounds, median reported:

* ``eager``          the model in PyTorch on the GPU, fp32
* ``torch.compile``  inductor, default mode
* ``aotinductor``    torch.export + aoti_compile_and_package + aoti_load_package
* ``kiln``           kiln.trace(device="cuda"), -O2 (TorchInductor)
* ``kiln-bf16``      the same with --auto-cast matmult --auto-cast-type bf16 (native on the GPU)

Needs a CUDA device; exits 2 with a message otherwise.
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


def on_gpu(case):
    case.model = case.model.cuda()
    case.args = tuple(a.cuda() for a in case.args)
    case.kwargs = {k: v.cuda() for k, v in case.kwargs.items()}
    return case


def runners(case, skip):
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
    if "aotinductor" not in skip:
        def aoti():
            with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
                ep = torch.export.export(m, args, kwargs)
                path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "m.pt2"))
                r = torch._inductor.aoti_load_package(path)
            return lambda: r(*args, **kwargs)
        out["aotinductor"] = aoti
    if "kiln" not in skip:
        def k():
            c = kiln.trace(m, args or None, kwargs or None, device="cuda", cache=False, quiet=True)
            return lambda: c(*args, **kwargs)
        out["kiln"] = k
    if "kiln-bf16" not in skip:
        def kb():
            c = kiln.trace(m, args or None, kwargs or None, device="cuda", cache=False, quiet=True,
                           compiler_args="--auto-cast matmult --auto-cast-type bf16", min_top1=0.0)
            return lambda: c(*args, **kwargs)
        out["kiln-bf16"] = kb
    return out


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run_case(name, rounds, per_round, skip):
    case = on_gpu(build_case(name, False, 0))
    built, results = {}, {}
    for key, make in runners(case, skip).items():
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
    for fn in built.values():
        for _ in range(5):
            fn()
    for _ in range(rounds):
        for key, fn in built.items():
            fn()
            results[key]["samples"] += [timed(fn) for _ in range(per_round)]
    ref = results["eager"]["_out"]
    base = statistics.median(results["eager"]["samples"])
    for key, r in results.items():
        if "samples" in r:
            r["median_ms"] = round(statistics.median(r["samples"]), 4)
            r["vs_eager"] = round(base / r["median_ms"], 3)
            r["cosine_vs_eager"] = cosine(ref, r.pop("_out"))
            del r["samples"]
    return {"model": case.description, "runners": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bert-base,resnet50")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--skip", default="")
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "gpu.json"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    skip = set(filter(None, a.skip.split(",")))
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    print(f"\n{out['device']}, torch {out['torch']}, batch 1, median of {a.rounds}x{a.per_round} calls")
    print(f"{'model':<10} {'runner':<14} {'ms':>9} {'vs eager':>9} {'cosine':>10}")
    for name in a.models.split(","):
        res = out["models"][name] = run_case(name, a.rounds, a.per_round, skip)
        with open(a.json, "w") as f:   # after each model: a later failure keeps what was measured
            json.dump(out, f, indent=1)
        for key, r in res["runners"].items():
            if "median_ms" in r:
                print(f"{name:<10} {key:<14} {r['median_ms']:>9.3f} {r['vs_eager']:>8.2f}x "
                      f"{r['cosine_vs_eager']:>10.6f}")
            else:
                print(f"{name:<10} {key:<14} {'error':>9}  {r['error'][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
