"""The ``kiln bench`` report: rows from the copies' replies, ratios to the baseline, and the JSON, table, notes and plot.

Everything here works on the plain JSON report, so a report read back from a
file renders the same as one just measured.
"""
from __future__ import annotations

import json
import os
import tempfile

from kiln.atomic import write_atomic
from kiln.errors import KilnError


def percentile(sorted_values, q):
    """The nearest-rank ``q``th percentile of already sorted values (None if there are none)."""
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def aggregate(runner, batch, copies, workers, replies, ready, price) -> dict:
    """One result row from every copy's window reply (and its ready message) for one configuration."""
    calls = sum(r["calls"] for r in replies)
    elapsed = max(r["elapsed"] for r in replies)
    lat = sorted(x for r in replies for x in r["latencies_ms"])
    throughput = calls * batch / elapsed if elapsed > 0 else 0.0
    row = {"runner": runner, "batch_size": batch, "copies": copies, "workers": workers,
           "calls": calls, "inferences": calls * batch, "duration_s": round(elapsed, 3),
           "throughput": round(throughput, 3),
           "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99),
                          # a copy with no call in the window has no max (None): not a TypeError
                          "max": max((r["max_ms"] for r in replies if r["max_ms"] is not None), default=None),
                          "mean": round(sum(r["sum_ms"] for r in replies) / calls, 4) if calls else None},
           "setup_s": round(max(r.get("setup_s", 0.0) for r in ready), 3),
           "cost_per_1m": round(price / 3600 / throughput * 1e6, 4) if price and throughput else None}
    shares = [r["host_share"] for r in replies if r.get("host_share") is not None]
    if shares:
        row["host_share"] = round(max(shares), 4)
    notes = sorted({r["note"] for r in ready if r.get("note")})
    if notes:
        row["note"] = "; ".join(notes)
    return row


def add_ratios(report):
    """Each row's throughput over the baseline runner's at the same batch, copies and workers."""
    base = report["baseline"]
    ref = {(r["batch_size"], r["copies"], r["workers"]): r for r in report["results"] if r["runner"] == base}
    for r in report["results"]:
        b = ref.get((r["batch_size"], r["copies"], r["workers"]))
        r[f"throughput_vs_{base}"] = round(r["throughput"] / b["throughput"], 3) \
            if b and b["throughput"] else None


def check_output(path, what: str):
    """Refuse, before anything is measured, an output path that cannot be written: a directory,
    or a directory that cannot be made or written to (until 12-01 that was found only after the
    whole run, with a traceback and no table; ``--plot /tmp`` also left ``/tmp.tmpPID.png``)."""
    target = os.path.abspath(os.fspath(path))
    if os.path.isdir(target):
        raise KilnError(f"bench: {what} {path} is a directory; give a file name")
    d = os.path.dirname(target)
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise KilnError(f"bench: cannot write {what} {path}: {e.strerror or e}") from None


def write_json(path, report):
    """Write the report atomically, so a reader never sees half of it."""
    write_atomic(path, lambda f: f.write(json.dumps(report, indent=1).encode()))


def table(report):
    """The report as a rich Table (p90 and the rest are in the JSON)."""
    from rich import box
    from rich.table import Table
    base = report["baseline"]
    t = Table(title=f"kiln bench: {report['target']}", header_style="bold", box=box.SIMPLE_HEAD)
    t.add_column("runner", no_wrap=True)
    for col in ("batch", "copies", "workers", "inf/s", "p50 ms", "p99 ms", "max ms", f"vs {base}"):
        t.add_column(col, justify="right")
    priced = report["config"]["price_per_hour"]
    if priced:
        t.add_column("$/1M inf", justify="right")
    for r in report["results"]:
        lat = r["latency_ms"]
        ratio = r.get(f"throughput_vs_{base}")
        cells = [_label(report, r["runner"]), str(r["batch_size"]), str(r["copies"]), str(r["workers"]), _fmt(r["throughput"]),
                 *(_fmt(lat[k]) for k in ("p50", "p99", "max")), f"{ratio:.2f}x" if ratio is not None else "-"]
        if priced:
            cells.append(f"{r['cost_per_1m']:.3g}" if r["cost_per_1m"] is not None else "-")
        t.add_row(*cells)
    return t


def notes(report) -> list[str]:
    """What the table cannot say: host fallback shares, dynamic batch, oversubscription, skipped peers."""
    out = []
    for r in report["results"]:
        said = []
        if r.get("host_share"):
            said.append(f"{100 * r['host_share']:.0f}% of its time on host fallback ops")
        if r.get("note"):
            said.append(r["note"])
        if said:
            out.append(f"{r['runner']} batch {r['batch_size']} copies {r['copies']} workers {r['workers']}: "
                       + "; ".join(said))
    out += [f"skipped {s['runner']}: {s['reason']}" for s in report["skipped"]]
    out += [f"kiln compile for batch {c['batch_size']}: {c['cache']} in {c['seconds']:.1f} s "
            f"({', '.join(c['engines']) or 'host'}), not measured" for c in report["compile"]]
    return out


def _label(report, runner) -> str:
    flags = report["config"].get("compile_options", {}).get("compiler_args")
    return f"kiln {flags}" if runner == "kiln" and flags else runner


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def plot(report, path):
    """Throughput vs p50 latency, one series per runner, one point per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for runner in dict.fromkeys(r["runner"] for r in report["results"]):
        rows = sorted((r for r in report["results"] if r["runner"] == runner and r["latency_ms"]["p50"] is not None),
                      key=lambda r: r["latency_ms"]["p50"])        # a window with no finished call has no point
        xs = [r["latency_ms"]["p50"] for r in rows]
        ys = [r["throughput"] for r in rows]
        ax.plot(xs, ys, marker="o", label=_label(report, runner))
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(f"b{r['batch_size']} c{r['copies']} w{r['workers']}", (x, y), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    from matplotlib.ticker import FormatStrFormatter
    if not any(r["latency_ms"]["p50"] is not None and r["throughput"] > 0 for r in report["results"]):
        ax.text(0.5, 0.5, "no call finished in any window: give a longer duration", ha="center",
                transform=ax.transAxes)
    else:
        ax.set_xscale("log")
        ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):   # plain numbers, not 10^x, on the log axes
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("latency p50 (ms)")
    ax.set_ylabel("throughput (inferences/s)")
    ax.set_title(f"kiln bench: {os.path.basename(str(report['target']))}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
