"""``kiln inspect``: an artifact's manifest, signer and whether this host trusts it.

It reads the file only: no engine is loaded and nothing from the artifact
runs, so it is safe on a file from anywhere.
"""
from __future__ import annotations

import json
import sys

from rich.table import Table

from kiln.cli.common import print_notes, validation_line
from kiln.compiler import quantized

# Container kinds whose manifest holds a table of nested artifacts: (record key, rows key).
_NESTED = {"bucketed": ("buckets", "variants"), "pipeline": ("pipeline", "stages")}


def add_parser(sub):
    sp = sub.add_parser("inspect", help="print an artifact's manifest, signer and whether it is "
                        "trusted here (loads no engine, runs nothing from the file)")
    sp.add_argument("artifact")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_inspect)


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
    speed = _speed_vs_eager(m)
    if speed:
        t.add_row("speed vs eager", speed)
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
    """One compiled model: its summary, then its inputs/outputs, partitions, engine choice and host ops."""
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
    if m.get("quantized"):
        t.add_row("quantized", f"{quantized.label(m['quantized'], m['compile_options'].get('quantize'))}: "
                               f"{quantized.describe(m['quantized'])}")
    val = m.get("validation")
    if val:
        t.add_row("validation", validation_line(val))
    speed = _speed_vs_eager(m)
    if speed:
        t.add_row("speed vs eager", speed)
    bad = _signature_rows(t, art, title)
    console.print(t)
    _print_model_tables(m, console)
    return bad


def _speed_vs_eager(m) -> str | None:
    """The measured speed against eager (device partitions only), and where eager runs."""
    from kiln.compiler.measure import summarize
    total = summarize(m.get("partitions", []))
    if not total:
        return None
    eager = total["eager_partitions"]
    return (f"{total['speed_vs_eager']:.2f}x (kiln {total['latency_ms']:.3g} ms, eager "
            f"{total['eager_latency_ms']:.3g} ms, measured at compile time)"
            + (f"; partition(s) {', '.join(map(str, eager))} run eagerly" if eager else ""))


def _print_model_tables(m, console):
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
    print_notes(m, console)
