"""``kiln analyze``, ``kiln compile`` and ``kiln run``: a model factory to a report or an artifact, and an artifact run.

kiln itself (and with it torch) is imported inside the handlers, so building
the parser for ``kiln --help`` loads none of it.
"""
from __future__ import annotations

import json
import os
import time

from rich.table import Table

from kiln.atomic import write_atomic
from kiln.cli.common import TRUST_HELP, positive_int, print_notes, validation_line
from kiln.factory import load_factory

# Commands whose unrecognised arguments are compiler flags: ``kiln compile m:f -O3 --target generic``.
TAKES_BARE_COMPILER_FLAGS = ("compile", "analyze")


def _split(example):
    return (None, example) if isinstance(example, dict) else (example, None)


def _model_args(sp):
    sp.add_argument("model", help="package.module:factory returning (model, example_inputs)")
    sp.add_argument("--path", help="directory to import the model's module from (default: cwd)")
    sp.add_argument("--engine", default=None)
    sp.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                    help="where the compiled model runs (default auto: an NVIDIA GPU when torch sees one)")
    sp.add_argument("--min-partition-size", type=int, default=None)
    sp.add_argument("--ops-on-host", nargs="*", default=None, help="ops forced to the host, e.g. aten::sort")
    sp.add_argument("--compiler-args", default=None,
                    help="Neuron-style flags, e.g. \"-O2 --target native\"")


def add_analyze(sub):
    sp = sub.add_parser("analyze", help="report op support and partitioning without compiling")
    _model_args(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_analyze)


def add_compile(sub):
    sp = sub.add_parser("compile", help="compile a model to a .kiln artifact")
    _model_args(sp)
    sp.add_argument("-o", "--output")
    sp.add_argument("--name")
    sp.add_argument("--no-fallback", action="store_true", help="fail on unsupported ops")
    sp.add_argument("--no-validate", action="store_true")
    sp.add_argument("--atol", type=float, default=None)
    sp.add_argument("--rtol", type=float, default=None)
    sp.add_argument("--cache", default=None, help="compile cache URL (default: KILN_CACHE_URL or ~/.cache/kiln)")
    sp.add_argument("--no-cache", action="store_true", help="compile without the cache")
    sp.add_argument("--retry-failed", action="store_true", help="retry a compile the cache remembers as failed")
    sp.set_defaults(fn=cmd_compile)


def add_run(sub):
    sp = sub.add_parser("run", help="run an artifact on .npy inputs")
    sp.add_argument("artifact")
    sp.add_argument("--input", nargs="+", default=[], help=".npy files, one per input tensor in order")
    sp.add_argument("--output", nargs="*", default=None, help=".npy file(s) to write the outputs to")
    sp.add_argument("--threads", type=positive_int, default=None)
    sp.add_argument("--repeat", type=positive_int, default=1)
    sp.add_argument("--trust-native-code", action="store_true", help=TRUST_HELP)
    sp.set_defaults(fn=cmd_run)


def cmd_analyze(a, console):
    import kiln
    model, example = load_factory(a.model, a.path)
    args, kwargs = _split(example)
    rep = kiln.analyze(model, args, kwargs, engine=a.engine, device=a.device, compiler_args=a.compiler_args,
                       min_partition_size=a.min_partition_size, ops_on_host=a.ops_on_host or None)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=1))
        return 0
    console.print(f"[bold]{rep.model_name}[/] on {rep.engine}: {rep.support_percentage:.1f}% of all "
                  f"operations ({sum(rep.supported_ops.values())} of {rep.total_ops}) are supported")
    t = Table("placement", "op", "count", "reason / location")
    for op, n in sorted(rep.supported_ops.items(), key=lambda kv: (-kv[1], kv[0])):
        t.add_row("device", op, str(n), "")
    for u in rep.unsupported_ops:
        t.add_row("[red]host[/]", u["op"], str(u["count"]), u["reason"] + "".join(
            f"\n at {loc}" for loc in u["locations"][:3]))
    console.print(t)
    for p in rep.partitions:
        console.print(f"partition {p['id']}: {p['num_ops']} ops")
    for n in rep.notes:
        console.print(f"[yellow]note:[/] {n}")
    return 0


def cmd_compile(a, console):
    import kiln
    model, example = load_factory(a.model, a.path)
    args, kwargs = _split(example)
    flags = list(a.compiler_args or [])
    compiled = kiln.trace(model, args, kwargs, engine=a.engine, device=a.device, compiler_args=flags or None,
                          fallback=not a.no_fallback, min_partition_size=a.min_partition_size,
                          ops_on_host=a.ops_on_host or None, validate=not a.no_validate,
                          atol=a.atol, rtol=a.rtol, name=a.name,
                          cache=False if a.no_cache else a.cache, retry_failed=a.retry_failed)
    out = a.output or (a.model.split(":")[-1] + ".kiln")
    compiled.save(out)
    v = compiled.manifest.get("validation")
    console.print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB) in "
                  f"{compiled.manifest['compile_seconds']:.1f}s; "
                  f"{compiled.report['support_percentage']:.1f}% of ops on {compiled.manifest['engine']['name']}")
    if compiled.manifest.get("cache"):
        c = compiled.manifest["cache"]
        how = "hit" if c["hit"] else "miss, stored" if c.get("stored", True) else "miss, NOT stored (the warning above says why)"
        console.print(f"cache: {how} {c['key'][:16]} in {c['url']}")
    if v:
        console.print(f"validation: {validation_line(v)}")
    print_notes(compiled.manifest, console)
    return 0


def cmd_run(a, console):
    import numpy as np
    import torch
    import kiln
    from kiln.artifact.container import refuse_llm
    refuse_llm(a.artifact, "kiln run")
    model = kiln.load(a.artifact, threads=a.threads, trust_native_code=a.trust_native_code or None)
    inputs = []
    for path in a.input:
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise kiln.KilnError(f"--input {path}: not a readable .npy array ({e}); write inputs with numpy.save "
                                 "(object arrays are refused: loading them would unpickle code)") from None
        inputs.append(torch.from_numpy(arr))
    flat = inputs
    model.check(flat)
    start = time.perf_counter()
    for _ in range(max(1, a.repeat)):
        outs = model.run_flat(flat)
    elapsed = (time.perf_counter() - start) / max(1, a.repeat)
    if a.output:
        paths = a.output
        if len(paths) == 1 and len(outs) > 1:
            stem, ext = os.path.splitext(paths[0])
            paths = [f"{stem}{i}{ext or '.npy'}" for i in range(len(outs))]
        if len(paths) != len(outs):
            raise kiln.KilnError(f"the model has {len(outs)} outputs but {len(paths)} --output paths were given")
        for p, o in zip(paths, outs):
            if os.path.isdir(p):
                raise kiln.KilnError(f"--output {p} is a directory; give a file name per output")
            array = o.numpy()
            write_atomic(p, lambda f, array=array: np.save(f, array, allow_pickle=False))   # no ".npy" appended
            console.print(f"wrote {p}: {tuple(o.shape)} {o.dtype}")
    else:
        for spec, o in zip(model.output_specs, outs):
            console.print(f"{spec.name}: {tuple(o.shape)} {o.dtype}")
    console.print(f"latency: {elapsed * 1e3:.3f} ms per call")
    return 0
