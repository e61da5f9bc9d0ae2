"""``kiln ls``, ``kiln monitor`` and ``kiln top``: what kiln is doing on this host right now."""
from __future__ import annotations

import json

from rich.table import Table

from kiln.cli.common import positive_int, positive_seconds
from kiln.observe.metrics import label


def add_ls(sub):
    sp = sub.add_parser("ls", help="this host's kiln cores, ISA, memory, engines and kiln processes")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--run-dir", default=None, help="registry directory (default: KILN_RUN_DIR or the user's run dir)")
    sp.set_defaults(fn=cmd_ls)


def add_monitor(sub):
    sp = sub.add_parser("monitor", help="a neuron-monitor style JSON report on stdout every period")
    sp.add_argument("--period", type=positive_seconds, default=5.0, help="seconds between reports (default 5)")
    sp.add_argument("--count", type=positive_int, default=None, help="stop after this many reports")
    sp.add_argument("--run-dir", default=None)
    sp.set_defaults(fn=cmd_monitor)


def add_top(sub):
    sp = sub.add_parser("top", help="live per-core and per-model view of the kiln processes (q quits)")
    sp.add_argument("--period", type=positive_seconds, default=1.0, help="refresh period in seconds (default 1)")
    sp.add_argument("--once", action="store_true", help="print one frame after one period and exit")
    sp.add_argument("--width", type=positive_int, default=None, help="render width (default: the terminal's)")
    sp.add_argument("--run-dir", default=None)
    sp.set_defaults(fn=cmd_top)


def cmd_ls(a, console):
    from kiln.observe import registry
    from kiln.observe.monitor import host_info
    info = host_info()
    info["processes"] = [{"pid": e["pid"], "cmd": e.get("cmd"), "tag": e.get("tag"),
                          "memory_rss_bytes": e.get("memory_rss_bytes"),
                          "models": [{**{k: m[k] for k in ("name", "kind", "core", "calls_completed", "calls_failed")},
                                      "served_as": m.get("served_as")}
                                     for m in registry.top_level(e)]}
                         for e in registry.processes(a.run_dir)]
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    _print_host(info, console)
    _print_processes(info, console)
    return 0


def _print_host(info, console):
    from kiln.host.cores import format_cpus
    t = Table("kiln core", "host core", "CPUs", "models", title=f"{len(info['cores'])} kiln cores")
    on_core: dict = {}
    for p in info["processes"]:
        for m in p["models"]:
            on_core.setdefault(m["core"], []).append(f"{label(m)} (pid {p['pid']})")
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


def _print_processes(info, console):
    pt = Table("pid", "memory", "model", "kind", "core", "calls", "failed", "command",
               title=f"{len(info['processes'])} kiln processes")
    for p in info["processes"]:
        cmd = (p["tag"] or p["cmd"] or "")[:40]
        rss = f"{(p['memory_rss_bytes'] or 0) / 2**20:.0f} MiB"
        for i, m in enumerate(p["models"] or [{"name": "-", "kind": "", "core": None, "calls_completed": "",
                                               "calls_failed": ""}]):
            first = i == 0
            pt.add_row(str(p["pid"]) if first else "", rss if first else "", label(m), m["kind"],
                       "all" if m["core"] is None else str(m["core"]), str(m["calls_completed"]),
                       str(m["calls_failed"]), cmd if first else "")
    console.print(pt)


def cmd_monitor(a, console):
    from kiln.observe import monitor
    return monitor.run(a.period, a.count, a.run_dir)


def cmd_top(a, console):
    from kiln.observe import top
    return top.run(a.period, a.run_dir, once=a.once, width=a.width)
