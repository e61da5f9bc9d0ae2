"""``kiln port``'s outputs: a terminal summary (rich), and with ``--out DIR`` a report in
Markdown and HTML (one page, pictures beside it, opens in any browser) and JSON."""
from __future__ import annotations

import html
import json
import os

from kiln.atomic import write_atomic
from kiln.port import draw


def write(report, out_dir: str) -> dict:
    """Pictures, ``report.md``, ``report.html`` and ``report.json`` in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    pictures = {}
    if report.graphs:
        pictures["graph"] = "graph.png"
        draw.graph_picture(report.graphs, report.engine_of, os.path.join(out_dir, "graph.png"))
    if report.cost.spans:
        pictures["latency"] = "latency.png"
        draw.latency_chart(report.cost.spans, report.cost.eager_ms, report.cost.kiln_ms,
                           os.path.join(out_dir, "latency.png"))
    report.pictures = pictures
    files = {"report.md": markdown(report), "report.html": to_html(report),
             "report.json": json.dumps(report.to_dict(), indent=2, default=str)}
    for name, text in files.items():
        data = text.encode()
        write_atomic(os.path.join(out_dir, name), lambda f, data=data: f.write(data))
    return {name: os.path.join(out_dir, name) for name in [*files, *pictures.values()]}


def _cost_rows(report) -> list:
    c = report.cost
    rows = [("route", c.route)]
    if c.error:
        rows.append(("error", c.error))
    if c.compile_seconds is not None:
        rows.append(("compile -O1", f"{c.compile_seconds:.2f} s (cold: the compile cache is not used)"))
    if c.artifact_bytes is not None:
        rows.append(("artifact", f"{c.artifact_bytes / 1e6:.2f} MB"))
    if c.eager_ms is not None:
        rows.append(("eager PyTorch", f"{c.eager_ms:.3f} ms per call (median)"))
        rows.append(("kiln", f"{c.kiln_ms:.3f} ms per call (median), {c.speedup:.2f}× eager"))
    if c.max_abs_difference is not None:
        rows.append(("answers", f"max abs difference {c.max_abs_difference:.3g} from eager"
                                + (f" ({c.tolerance})" if c.tolerance else "")))
    if report.llm is not None:
        rows.append(("LLM path", report.llm.get("command") if report.llm["supported"] else report.llm["why"]))
    return rows


def markdown(report) -> str:
    d = report.to_dict()
    lines = [f"# kiln port: {report.model}", "", f"Source: `{report.source}`", "",
             f"**Tier {report.tier}** — {report.tier_text}.", "",
             f"{d['ops']['total']} operations, {d['ops']['host']} on the host; "
             f"{'captured as one graph' if report.captured_whole else 'not capturable as one graph'}"
             f"{f', {report.graph_breaks} graph break(s)' if report.graph_breaks else ''}.", "",
             "## Blockers", ""]
    if not report.blockers:
        lines.append("None: `kiln.trace(model, example)` compiles it as it is.")
    for b in report.blockers:
        lines += [f"- **{b.kind}** (tier {b.tier}): {b.what}", f"  - at: `{b.where or 'unknown line'}`",
                  f"  - fix: {b.fix}"]
    lines += ["", "## Recompile hazards", ""]
    lines += [f"- {h['what']}\n  - fix: {h['fix']}" for h in report.hazards] or ["None found."]
    lines += ["", "## Cost", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _cost_rows(report)]
    lines += ["", "## Partitions", "", "| graph | partition | engine | ops |", "|---|---|---|---|"]
    for k, g in enumerate(report.graphs):
        lines += [f"| {g.name} | {p['id']} | {report.engine_of(k, p['id'])} | {p['num_ops']} |" for p in g.partitions]
    if report.cost.spans:
        lines += ["", "| span | kind | ms per call |", "|---|---|---|"]
        lines += [f"| {s['name']} | {s['kind']} | {s['ms']:.4f} |" for s in report.cost.spans]
    for name, title in (("graph", "The captured graph, coloured by engine (host ops: red X)"),
                        ("latency", "Where a call's time goes")):
        if name in report.pictures:
            lines += ["", f"## {title}", "", f"![{title}]({report.pictures[name]})"]
    lines += ["", *(f"- note: {n}" for n in report.notes), "",
              f"Ported in {report.seconds:.1f} s by kiln port."]
    return "\n".join(lines) + "\n"


def to_html(report) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>kiln port: {e(report.model)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}td,th{border:1px solid #ccc;"
             "padding:3px 8px}table{border-collapse:collapse}code{background:#f4f4f4}.tier{font-size:1.4em}"
             "img{max-width:100%}</style></head><body>",
             f"<h1>kiln port: {e(report.model)}</h1><p>Source: <code>{e(report.source)}</code></p>",
             f"<p class='tier tier-{report.tier}'><b>Tier {report.tier}</b>: {e(report.tier_text)}</p>",
             "<h2>Blockers</h2>"]
    if report.blockers:
        parts.append("<table><tr><th>kind</th><th>tier</th><th>what</th><th>where</th><th>fix</th></tr>")
        parts += [f"<tr class='blocker'><td>{e(b.kind)}</td><td>{b.tier}</td><td>{e(b.what)}</td>"
                  f"<td><code>{e(b.where or 'unknown line')}</code></td><td>{e(b.fix)}</td></tr>"
                  for b in report.blockers]
        parts.append("</table>")
    else:
        parts.append("<p>None: <code>kiln.trace(model, example)</code> compiles it as it is.</p>")
    parts.append("<h2>Recompile hazards</h2><ul>")
    parts += [f"<li>{e(h['what'])}<br>fix: {e(h['fix'])}</li>" for h in report.hazards] or ["<li>None found.</li>"]
    parts.append("</ul><h2>Cost</h2><table>")
    parts += [f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in _cost_rows(report)]
    parts.append("</table>")
    for name, title in (("graph", "The captured graph, coloured by engine (host ops: red X)"),
                        ("latency", "Where a call's time goes")):
        if name in report.pictures:
            parts.append(f"<h2>{e(title)}</h2><img src='{e(report.pictures[name])}' alt='{e(title)}'>")
    parts += [f"<p>note: {e(n)}</p>" for n in report.notes]
    parts.append(f"<p>Ported in {report.seconds:.1f} s by kiln port.</p></body></html>")
    return "\n".join(parts) + "\n"


def summary(report, console) -> None:
    """The terminal summary: tier, blockers, cost."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table
    style = {1: "green", 2: "yellow", 3: "red"}[report.tier]
    console.print(Panel(f"[bold]Tier {report.tier}[/bold]: {report.tier_text}", title=f"kiln port: {report.model}",
                        border_style=style))
    if report.blockers:
        table = Table("kind", "what", "where", "fix", title="blockers", show_lines=True)
        for b in report.blockers:
            table.add_row(b.kind, escape(b.what), escape(b.where or "?"), escape(b.fix))
        console.print(table)
    for h in report.hazards:
        console.print(f"[yellow]hazard[/yellow]: {escape(h['what'])}\n  fix: {escape(h['fix'])}")
    table = Table(title="cost", show_header=False)
    for k, v in _cost_rows(report):
        table.add_row(k, escape(str(v)))
    console.print(table)
    for n in report.notes:
        console.print(f"note: {escape(n)}")
