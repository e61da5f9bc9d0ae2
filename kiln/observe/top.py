"""``kiln top``: a live view of the host's kiln cores and the models running on them.

Built on rich so it draws in any terminal (ssh, tmux, an 80x24 console) with
no curses. The numbers are ``kiln monitor``'s reports (kiln/monitor.py), one
per refresh; ``render`` turns a report into a frame, so the view can be
rendered headless (``--once``, or through a rich Console in tests).
Keys are read in cbreak mode from the terminal: ``q`` (or Ctrl-C) quits.
"""
from __future__ import annotations

import os
import select
import sys
import time

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kiln.observe.metrics import label
from kiln.observe.monitor import Sampler


def _bar(pct: float, width: int = 10) -> Text:
    pct = max(0.0, min(pct, 100.0))
    full = round(pct / 100 * width)
    style = "green" if pct < 60 else "yellow" if pct < 90 else "red"
    return Text("█" * full, style=style) + Text("·" * (width - full), style="dim")


def _mib(n) -> str:
    return f"{(n or 0) / 2**20:.0f}M"


def render(report: dict, max_rows: int = 12) -> Group:
    """One frame: the host line, per-core utilization, then one row per model."""
    hw = report["neuron_hardware_info"]
    mem = report["system_data"]["memory_info"]
    cpu = report["system_data"]["vcpu_usage"]["average_usage"]
    busy_cpu = 100 - cpu.get("idle", 100) - cpu.get("iowait", 0)
    procs = report["neuron_runtime_data"]
    header = Text.assemble(
        ("kiln top", "bold"), f"  {hw['neuroncore_count']} cores  cpu {busy_cpu:.0f}%  "
        f"mem {mem['memory_used_bytes'] / 2**30:.1f}/{mem['memory_total_bytes'] / 2**30:.1f}G  "
        f"{len(procs)} proc  ", (report["timestamp"][11:19], "dim"), ("  q quits", "dim"))

    in_use: dict = {}
    for p in procs:
        for core, c in p["report"]["neuroncore_counters"]["neuroncores_in_use"].items():
            u = in_use.setdefault(core, [0.0, []])
            u[0] += c["neuroncore_utilization"]
            u[1] += c["models"]
    cores = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    for col, kw in (("core", {"justify": "right"}), ("cpu%", {"justify": "right"}), ("cpu", {}),
                    ("model%", {"justify": "right"}), ("models", {"overflow": "ellipsis", "no_wrap": True,
                                                             "max_width": 30})):
        cores.add_column(col, **kw)
    cpu_by_core = report["system_data"].get("kiln_core_cpu_usage", {})
    for core in hw["cores"]:
        pct = cpu_by_core.get(core, 0.0)
        util, names = in_use.get(core, [0.0, []])
        cores.add_row(core, f"{pct:.0f}", _bar(pct), f"{min(util, 100):.0f}", ", ".join(sorted(set(names))))
    if "unpinned" in in_use:
        util, names = in_use["unpinned"]
        cores.add_row("-", "", "", f"{util:.0f}", ", ".join(sorted(set(names))))

    models = Table(box=None, pad_edge=False, header_style="bold")
    for col, kw in (("pid", {"justify": "right"}), ("model", {"overflow": "ellipsis", "no_wrap": True,
                                                              "max_width": 18}),
                    ("core", {"justify": "right"}), ("req/s", {"justify": "right"}),
                    ("p50ms", {"justify": "right"}), ("p99ms", {"justify": "right"}),
                    ("host%", {"justify": "right"}), ("fail", {"justify": "right"}),
                    ("calls", {"justify": "right"}), ("mem", {"justify": "right"})):
        models.add_column(col, **kw)
    rows = [(p, m) for p in procs for m in p["report"]["models"]]
    rows.sort(key=lambda pm: -pm[1]["throughput"])
    for p, m in rows[:max_rows]:
        lat = m["latency_ms"]
        host = 100 * m["host_share"]
        models.add_row(str(p["pid"]), label(m), "-" if m["core"] is None else str(m["core"]),
                       f"{m['throughput']:.1f}", _num(lat["p50"]), _num(lat["p99"]),
                       Text(f"{host:.0f}", style="red" if host >= 10 else ""),
                       Text(str(m["failed_total"]), style="red" if m["failed"] else ""),
                       str(m["completed_total"]),
                       _mib(p["report"]["memory_used"]["neuron_runtime_used_bytes"]["host"]))
    parts = [header, cores, models]
    if len(rows) > max_rows:
        parts.append(Text(f"... {len(rows) - max_rows} more models", style="dim"))
    if not rows:
        parts.append(Text("no kiln models running (processes announce themselves when they load one)",
                          style="dim"))
    return Group(*parts)


def _num(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def run(period: float = 1.0, directory: str | None = None, once: bool = False, width: int | None = None,
        console: Console | None = None) -> int:
    console = console or Console(width=width)
    sampler = Sampler(directory)
    interactive = not once and sys.stdin.isatty() and console.is_terminal
    if not interactive:
        time.sleep(period)
        console.print(render(sampler.sample(), max_rows=max(4, console.height - 10)))
        return 0
    import termios
    import tty
    from rich.live import Live
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        with Live(console=console, screen=True, auto_refresh=False) as live:
            live.update(Text("kiln top: sampling...", style="dim"), refresh=True)
            time.sleep(min(period, 0.5))
            deadline = time.monotonic()
            while True:
                deadline += period
                live.update(render(sampler.sample(), max_rows=max(4, console.height - 10)), refresh=True)
                while (left := deadline - time.monotonic()) > 0:
                    ready, _, _ = select.select([fd], [], [], left)
                    if ready and os.read(fd, 1) in (b"q", b"Q"):
                        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
