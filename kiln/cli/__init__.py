"""The ``kiln`` command line: analyze, compile, run, inspect.

A model is named ``package.module:factory``; the factory returns
``(model, example_inputs)`` where example_inputs is a tensor, a tuple of
positional inputs or a dict of keyword inputs. ``--path DIR`` (default: the
current directory) is put on ``sys.path`` so local modules can be named.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from rich.console import Console
from rich.table import Table


def load_factory(spec: str, path: str | None):
    from kiln.errors import KilnError
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise KilnError(f"model must be named package.module:factory, got {spec!r}")
    sys.path.insert(0, os.path.abspath(path or os.getcwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise KilnError(f"cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise KilnError(f"{module_name} has no attribute {attr!r}")
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise KilnError(f"{spec} must return (model, example_inputs)")
    return made


def _split(example):
    return (None, example) if isinstance(example, dict) else (example, None)


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
        console.print(f"cache: {'hit' if c['hit'] else 'miss, stored'} {c['key'][:16]} in {c['url']}")
    if v:
        console.print(f"validation: max abs error {v['max_abs_error']:.3g}, "
                      f"cosine {v['min_cosine_similarity']:.6f} (atol {v['atol']}, rtol {v['rtol']})")
    return 0


def cmd_run(a, console):
    import numpy as np
    import torch
    import kiln
    model = kiln.load(a.artifact, threads=a.threads, trust_native_code=a.trust_native_code or None)
    inputs = []
    for path in a.input:
        arr = np.load(path, allow_pickle=False)
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
            np.save(p, o.numpy(), allow_pickle=False)
            console.print(f"wrote {p}: {tuple(o.shape)} {o.dtype}")
    else:
        for spec, o in zip(model.output_specs, outs):
            console.print(f"{spec.name}: {tuple(o.shape)} {o.dtype}")
    console.print(f"latency: {elapsed * 1e3:.3f} ms per call")
    return 0


def cmd_cache(a, console):
    from kiln.compiler import cache as cache_mod
    url = a.url or cache_mod.resolve_url(None) or cache_mod.default_url()
    store = cache_mod.Cache(url)
    entries = sorted(store.entries(), key=lambda e: e.get("last_used", ""), reverse=True)
    if a.action == "ls":
        if a.json:
            print(json.dumps(entries, indent=1))
            return 0
        print(f"kiln cache {url}: {len(entries)} entries, "
              f"{sum(int(e.get('size', 0)) for e in entries) / 1e6:.1f} MB")
        if not entries:
            return 0
        t = Table("model", "key", "size", "engine", "status", "created", "last used", "uses")
        for e in entries:
            t.add_row(str(e.get("model_name")), e["key"][:16], f"{int(e.get('size', 0)) / 1e6:.2f} MB",
                      str(e.get("engine", "")), e.get("status", "?"), str(e.get("created", ""))[:19],
                      str(e.get("last_used", ""))[:19], str(e.get("uses", 0)))
        console.print(t)
        return 0
    if a.action == "info":
        if not a.key:
            print(json.dumps({"url": url, "entries": len(entries),
                              "bytes": sum(int(e.get("size", 0)) for e in entries),
                              "max_bytes": store.max_bytes}, indent=1))
            return 0
        match = [e for e in entries if e["key"].startswith(a.key)]
        if len(match) != 1:
            from kiln.errors import KilnError
            raise KilnError(f"{len(match)} cache entries match key {a.key!r}; give more of the key")
        print(json.dumps(match[0], indent=1))
        return 0
    if a.action == "prune":
        if a.max_bytes or store.max_bytes is not None:
            removed = store.evict(cache_mod._parse_size(a.max_bytes) if a.max_bytes else None)
        else:
            removed = [e for e in entries if e.get("status") != "ok"]
            for e in removed:
                store.forget(e["key"])
        console.print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, "
                      f"{sum(int(e.get('size', 0)) for e in removed) / 1e6:.1f} MB")
        return 0
    store.clear()
    console.print(f"cleared {len(entries)} entries from {url}")
    return 0


def cmd_parallel_compile(a, console):
    from kiln.compiler.collect import parallel_compile
    from kiln.errors import KilnError
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise KilnError("kiln parallel-compile needs a command: kiln parallel-compile -- python script.py")
    summary = parallel_compile(command, workers=a.workers, cache_url=a.cache)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if any(not j["ok"] for j in summary["jobs"]) else 0


def cmd_ls(a, console):
    from kiln.observe import registry
    from kiln.observe.monitor import host_info
    info = host_info()
    info["processes"] = [{"pid": e["pid"], "cmd": e.get("cmd"), "tag": e.get("tag"),
                          "memory_rss_bytes": e.get("memory_rss_bytes"),
                          "models": [{k: m[k] for k in ("name", "kind", "core", "calls_completed", "calls_failed")}
                                     for m in registry.top_level(e)]}
                         for e in registry.processes(a.run_dir)]
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    from kiln.host.cores import format_cpus
    t = Table("kiln core", "host core", "CPUs", "models", title=f"{len(info['cores'])} kiln cores")
    on_core: dict = {}
    for p in info["processes"]:
        for m in p["models"]:
            on_core.setdefault(m["core"], []).append(f"{m['name']} (pid {p['pid']})")
    for c in info["cores"]:
        t.add_row(str(c["id"]), str(c["host_index"]), format_cpus(c["cpus"]), ", ".join(on_core.get(c["id"], [])))
    console.print(t)
    console.print(f"arch {info['arch']}; ISA: {' '.join(info['isa']) or '-'}")
    console.print(f"memory: {info['memory_available_bytes'] / 2**30:.1f} GiB free of "
                  f"{info['memory_total_bytes'] / 2**30:.1f} GiB")
    e = Table("engine", "version", title="engines")
    for name, version in info["engines"].items():
        e.add_row(name, version or "not installed")
    console.print(e)
    pt = Table("pid", "memory", "model", "kind", "core", "calls", "failed", "command",
               title=f"{len(info['processes'])} kiln processes")
    for p in info["processes"]:
        cmd = (p["tag"] or p["cmd"] or "")[:40]
        rss = f"{(p['memory_rss_bytes'] or 0) / 2**20:.0f} MiB"
        for i, m in enumerate(p["models"] or [{"name": "-", "kind": "", "core": None, "calls_completed": "",
                                               "calls_failed": ""}]):
            first = i == 0
            pt.add_row(str(p["pid"]) if first else "", rss if first else "", m["name"], m["kind"],
                       "all" if m["core"] is None else str(m["core"]), str(m["calls_completed"]),
                       str(m["calls_failed"]), cmd if first else "")
    console.print(pt)
    return 0


def _ints(text, what):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"kiln bench: {what} must be comma-separated integers, got {text!r}") from None


def cmd_bench(a, console):
    from kiln import benchmark as bench
    if a.trust_native_code:   # the copies are processes of their own: they read it from the environment
        os.environ["KILN_TRUST_NATIVE_CODE"] = "1"
    options = {"compiler_args": a.compiler_args} if a.compiler_args else {}
    report = bench.bench(
        a.target, path=a.path, batch_sizes=_ints(a.batch_sizes, "--batch-sizes"),
        copies=_ints(a.copies, "--copies") if a.copies else None, workers=_ints(a.workers, "--workers"),
        duration=a.duration, warmup=a.warmup, compare=[c for c in (a.compare or "").split(",") if c],
        price_per_hour=a.price_per_hour, json_path=a.json, plot_path=a.plot, quiet=a.quiet,
        compile_options=options)
    if not console.is_terminal:   # a file or pipe: no need to squeeze the table into 80 columns
        console = Console(width=120)
    console.print(bench.table(report))
    for line in bench.notes(report):
        console.print(line, highlight=False, markup=False)
    if a.json:
        console.print(f"JSON: {a.json}")
    if a.plot:
        console.print(f"plot: {a.plot}")
    return 0 if report["results"] else 1


def cmd_monitor(a, console):
    from kiln.observe import monitor
    if a.period <= 0:
        raise SystemExit("kiln monitor: --period must be positive")
    return monitor.run(a.period, a.count, a.run_dir)


def cmd_top(a, console):
    from kiln.observe import top
    return top.run(a.period, a.run_dir, once=a.once, width=a.width)


def cmd_inspect(a, console):
    from kiln.artifact.container import Artifact
    art = Artifact.load(a.artifact)
    if a.json:
        print(json.dumps(art.manifest, indent=1))
        return 0
    bad = _inspect(art, a.artifact, console)
    if bad:
        print(f"kiln: error: {bad}", file=sys.stderr)
        return 2
    return 0


def cmd_key(a, console):
    from kiln.artifact import trust
    key = trust.host_key()
    public = trust._public_bytes(key)
    if a.json:
        print(json.dumps({"public_key": trust.encode_key(public), "fingerprint": trust.fingerprint(public),
                          "directory": trust.config_dir()}, indent=1))
        return 0
    print(trust.encode_key(public))
    print(f"{trust.fingerprint(public)}: this host's artifact signing key, in {trust.config_dir()}. "
          "Other hosts trust it when this public key (or a file holding it) is in their "
          "KILN_TRUSTED_KEYS.", file=sys.stderr)
    return 0


def _signature_rows(t, art, title):
    """The signer and whether this host trusts it; returns the error of a bad signature."""
    from kiln.artifact import trust
    d = trust.describe(art, title)
    if not d["valid"]:
        t.add_row("signature", f"[red]INVALID[/]: {d['error']}")
        return d["error"]
    t.add_row("signed by", f"{d['signer']} (public key {d['public_key']})" if d["signer"] else "unsigned")
    t.add_row("trusted here", f"yes: {d['trusted']}" if d["trusted"] else
              "no" if d["native"] else "no (not needed: it holds no native code)")
    if d["native"]:
        loads = "loads here" if d["trusted"] else "loads here only with --trust-native-code"
        t.add_row("native code", f"{', '.join(d['native'])}: {loads}")
    return None


_NESTED = {"bucketed": ("buckets", "variants"), "pipeline": ("pipeline", "stages")}


def _inspect(art, title, console):
    """Print one artifact; shape adapters and pipelines print their record, then each
    nested artifact (bucket variants, pipeline stages, the dynamic-batch inner model)."""
    m = art.manifest
    kind = m.get("kind", "model")
    if kind == "model":
        return _inspect_model(art, title, console)
    t = Table(title=f"{title} ({kind})", show_header=False)
    for key in ("model_name", "format_version", "kiln_version", "created"):
        t.add_row(key, str(m.get(key)))
    if kind == "dynamic_batch":
        t.add_row("compiled batch", str(m["dynamic_batch"]["batch_size"]))
    bad = _signature_rows(t, art, title)
    console.print(t)
    nested = sorted(name for name in art.blobs if name.endswith(".kiln"))
    if kind in _NESTED:
        record = m.get(_NESTED[kind][0], {})
        rows = record.get(_NESTED[kind][1], [])
        if rows:
            keys = [k for k in rows[0] if k not in ("inputs",)]
            rt = Table(*keys, title=_NESTED[kind][1])
            for row in rows:
                rt.add_row(*(str(row.get(k)) for k in keys))
            console.print(rt)
    for name in nested:
        bad = _inspect(art.nested(name, f"{title}:{name}"), f"{title}:{name}", console) or bad
    return bad


def _inspect_model(art, title, console):
    m = art.manifest
    t = Table(title=f"{title}", show_header=False)
    for key in ("model_name", "format_version", "kiln_version", "torch_version", "created", "compile_seconds"):
        t.add_row(key, str(m.get(key)))
    t.add_row("engine", f"{m['engine']['name']} {m['engine']['version']}")
    if m.get("cache"):
        t.add_row("cache key", m["cache"]["key"])
    t.add_row("target", f"{m['target']['target']} {m['target']['arch']}: {' '.join(m['target']['isa'])}")
    if m["target"].get("device") == "cuda":
        gpu = m["target"].get("cuda", {})
        t.add_row("device", f"cuda: {gpu.get('name')} (compute capability {gpu.get('capability')}, "
                            f"CUDA {gpu.get('cuda')})")
    opts = m["compile_options"]
    t.add_row("options", ", ".join(f"{k}={v}" for k, v in opts.items()))
    rep = m.get("report", {})
    t.add_row("support", f"{rep.get('support_percentage')}% of {rep.get('total_ops')} ops on device")
    val = m.get("validation")
    if val:
        t.add_row("validation", f"max abs {val['max_abs_error']:.3g}, max rel {val['max_rel_error']:.3g}, "
                                f"cosine {val['min_cosine_similarity']:.6f}")
    bad = _signature_rows(t, art, title)
    console.print(t)
    for title, key in (("inputs", "inputs"), ("outputs", "outputs")):
        io = Table("name", "shape", "dtype", title=title)
        for s in m[key]["tensors"]:
            io.add_row(s["name"], str(tuple(s["shape"])), s["dtype"])
        console.print(io)
    pt = Table("id", "engine", "ops", "inputs", "outputs", "compile s", "blob", "size", "sha256", title="partitions")
    for p in m["partitions"]:
        blob = m["blobs"][p["blob"]]
        pt.add_row(str(p["id"]), f"{p['engine']} {p['engine_version']}", str(p["num_ops"]),
                   str(len(p["inputs"])), str(len(p["outputs"])), str(p["compile_seconds"]),
                   p["blob"], f"{blob['size'] / 1e6:.2f} MB", blob["sha256"][:16])
    console.print(pt)
    ct = Table("partition", "engine", "status", "compile s", "latency ms", "note", title="engine choice")
    for p in m["partitions"]:
        for c in p.get("candidates", []):
            chosen = (c["engine"], c.get("variant")) == (p["engine"], p.get("variant")) and c["status"] == "ok"
            name = c["engine"] + (f":{c['variant']}" if c.get("variant") else "")
            ct.add_row(str(p["id"]), ("* " if chosen else "  ") + name, c["status"],
                       str(c.get("compile_seconds", "")), str(c.get("latency_ms", "")),
                       (c.get("note") or (p["choice"] if chosen else ""))[:80])
    if ct.row_count:
        console.print(ct)
    if m.get("precision"):
        console.print(f"precision: {m['precision']['note']}")
    host = [s for s in m["program"]["steps"] if "op" in s]
    if host:
        ht = Table("op", title="host (fallback) ops")
        for s in host:
            ht.add_row(s["op"])
        console.print(ht)
    return bad


_TRUST_HELP = ("load native code (TorchInductor partitions) from an artifact that no key trusted here "
               "signed (as KILN_TRUST_NATIVE_CODE=1); only for artifacts from a source you trust")


def build_parser():
    p = argparse.ArgumentParser(prog="kiln", description="Compile PyTorch models ahead of time and run them.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def model_args(sp):
        sp.add_argument("model", help="package.module:factory returning (model, example_inputs)")
        sp.add_argument("--path", help="directory to import the model's module from (default: cwd)")
        sp.add_argument("--engine", default=None)
        sp.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="where the compiled model runs (default auto: an NVIDIA GPU when torch sees one)")
        sp.add_argument("--min-partition-size", type=int, default=None)
        sp.add_argument("--ops-on-host", nargs="*", default=None, help="ops forced to the host, e.g. aten::sort")
        sp.add_argument("--compiler-args", default=None,
                        help="Neuron-style flags, e.g. \"-O2 --target native\"")

    sp = sub.add_parser("analyze", help="report op support and partitioning without compiling")
    model_args(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_analyze)

    sp = sub.add_parser("compile", help="compile a model to a .kiln artifact")
    model_args(sp)
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

    sp = sub.add_parser("run", help="run an artifact on .npy inputs")
    sp.add_argument("artifact")
    sp.add_argument("--input", nargs="+", default=[], help=".npy files, one per input tensor in order")
    sp.add_argument("--output", nargs="*", default=None, help=".npy file(s) to write the outputs to")
    sp.add_argument("--threads", type=int, default=None)
    sp.add_argument("--repeat", type=int, default=1)
    sp.add_argument("--trust-native-code", action="store_true", help=_TRUST_HELP)
    sp.set_defaults(fn=cmd_run)

    sp = sub.add_parser("inspect", help="print an artifact's manifest, signer and whether it is "
                        "trusted here (loads no engine, runs nothing from the file)")
    sp.add_argument("artifact")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_inspect)

    sp = sub.add_parser("key", help="print this host's artifact signing key (made on first use), "
                        "for other hosts' KILN_TRUSTED_KEYS")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_key)

    sp = sub.add_parser("ls", help="this host's kiln cores, ISA, memory, engines and kiln processes")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--run-dir", default=None, help="registry directory (default: KILN_RUN_DIR or the user's run dir)")
    sp.set_defaults(fn=cmd_ls)

    sp = sub.add_parser("bench", help="throughput and latency of an artifact or model factory, "
                        "optionally against eager/torchscript/torch.compile/onnxruntime/openvino")
    sp.add_argument("target", help="a .kiln artifact or package.module:factory returning (model, example_inputs)")
    sp.add_argument("--path", help="directory to import the factory's module from (default: cwd)")
    sp.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,4,8 (default 1)")
    sp.add_argument("--copies", default=None, help="model copies, one process per kiln core, e.g. 1,2 "
                    "(default: one per kiln core)")
    sp.add_argument("--workers", default="1", help="threads calling each copy, e.g. 1,2 (default 1)")
    sp.add_argument("--duration", type=float, default=5.0, help="measured seconds per configuration")
    sp.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before each runner")
    sp.add_argument("--compare", default=None, help="peers: eager,torchscript,torch.compile,onnxruntime,openvino")
    sp.add_argument("--price-per-hour", type=float, default=None, help="instance price, for cost per 1M inferences")
    sp.add_argument("--compiler-args", default=None, help="kiln compile flags for a factory, e.g. \"-O3\"")
    sp.add_argument("--json", default=None, help="write the report here")
    sp.add_argument("--plot", default=None, help="write a throughput-vs-latency PNG here")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp.add_argument("--trust-native-code", action="store_true", help=_TRUST_HELP)
    sp.set_defaults(fn=cmd_bench)

    sub.add_parser("serve", help="serve .kiln artifacts over HTTP (Open Inference Protocol / KServe v2); "
                   "see kiln serve --help")

    sp = sub.add_parser("monitor", help="a neuron-monitor style JSON report on stdout every period")
    sp.add_argument("--period", type=float, default=5.0, help="seconds between reports (default 5)")
    sp.add_argument("--count", type=int, default=None, help="stop after this many reports")
    sp.add_argument("--run-dir", default=None)
    sp.set_defaults(fn=cmd_monitor)

    sp = sub.add_parser("top", help="live per-core and per-model view of the kiln processes (q quits)")
    sp.add_argument("--period", type=float, default=1.0, help="refresh period in seconds (default 1)")
    sp.add_argument("--once", action="store_true", help="print one frame after one period and exit")
    sp.add_argument("--width", type=int, default=None, help="render width (default: the terminal's)")
    sp.add_argument("--run-dir", default=None)
    sp.set_defaults(fn=cmd_top)

    sp = sub.add_parser("cache", help="show and manage the compile cache")
    sp.add_argument("action", choices=("ls", "info", "prune", "clear"))
    sp.add_argument("key", nargs="?", help="info: an entry's key (a unique prefix is enough)")
    sp.add_argument("--url", default=None, help="cache URL (default: KILN_CACHE_URL or ~/.cache/kiln)")
    sp.add_argument("--max-bytes", default=None, help="prune: evict least-recently-used entries down to "
                    "this size (e.g. 2G; default KILN_CACHE_MAX_BYTES); without it, prune drops failed entries")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_cache)

    sp = sub.add_parser("parallel-compile", help="collect the graphs a script compiles, then compile "
                        "them in parallel into the cache: kiln parallel-compile -- python train.py ...")
    sp.add_argument("--workers", type=int, default=None, help="compile processes (default: one per CPU)")
    sp.add_argument("--cache", default=None, help="cache URL (default: KILN_CACHE_URL or ~/.cache/kiln)")
    sp.add_argument("--json", default=None, help="write the per-graph results to this file")
    sp.add_argument("command", nargs=argparse.REMAINDER, help="the script to run, after --")
    sp.set_defaults(fn=cmd_parallel_compile)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:   # its own parser; starlette/uvicorn load only when serving
        from kiln.serving.server import main as serve_main
        return serve_main(argv[1:])
    args, extra = build_parser().parse_known_args(argv)
    if extra:
        # Compiler flags may be given bare after the model: kiln compile m:f -O3 --target generic
        if args.cmd in ("compile", "analyze"):
            args.compiler_args = (args.compiler_args.split() if args.compiler_args else []) + extra
        else:
            build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    elif args.cmd in ("compile", "analyze") and args.compiler_args:
        args.compiler_args = args.compiler_args.split()
    console = Console(stderr=False)
    from kiln.errors import KilnError
    try:
        return args.fn(args, console)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
