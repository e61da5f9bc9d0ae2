"""The report's pictures, drawn with matplotlib (headless, Agg): the captured graph with each
operation coloured by the engine of its partition and host operations marked, and where a
call's time goes, partition by partition.

The graph is laid out in layers (networkx's topological generations, top to bottom), which
reads like the model's forward: each row holds operations whose inputs are all above it.
"""
from __future__ import annotations

import re

ENGINE_COLOURS = {"onnxruntime": "#1f77b4", "openvino": "#6a3d9a", "inductor": "#ff7f0e", "torchscript": "#2ca02c"}
HOST = "#d62728"
OTHER = "#7f7f7f"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def colour(engine: str | None) -> str:
    return ENGINE_COLOURS.get(engine or "", OTHER)


def graph_picture(placed_graphs, engines_of, path: str) -> str:
    """``placed_graphs``: :class:`kiln.port.graphs.Placed` per graph; ``engines_of(g, pid)``:
    the engine partition ``pid`` of graph ``g`` ended up on."""
    import networkx as nx
    plt = _pyplot()
    layouts, depth = [], 1
    for placed in placed_graphs:
        g = nx.DiGraph()
        g.add_nodes_from(range(len(placed.nodes)))
        g.add_edges_from(placed.edges)
        layers = _layers(g, nx)
        pos = {}
        for y, layer in enumerate(layers):
            for x, n in enumerate(sorted(layer)):
                pos[n] = (x - (len(layer) - 1) / 2, -y)
        layouts.append(pos)
        depth = max(depth, len(layers))
    width = max(4.0, 3.5 * len(placed_graphs))
    fig, axes = plt.subplots(1, len(placed_graphs), figsize=(width, min(60.0, 2.5 + 0.13 * depth)), squeeze=False)
    for k, (placed, pos, ax) in enumerate(zip(placed_graphs, layouts, axes[0])):
        _draw_one(ax, placed, pos, lambda pid, k=k: engines_of(k, pid))
    handles = _legend(plt, {e for k, p in enumerate(placed_graphs) for e in
                            (engines_of(k, q["id"]) for q in p.partitions)})
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _layers(g, nx) -> list:
    """Rows of the picture: each op one row below its deepest input; ops with no inputs
    (constants, aranges) one row above their first user rather than all in the top row."""
    level = {}
    for n in nx.topological_sort(g):
        level[n] = 1 + max((level[p] for p in g.predecessors(n)), default=-1)
    for n in g.nodes:
        if g.in_degree(n) == 0 and g.out_degree(n):
            level[n] = max(0, min(level[u] for u in g.successors(n)) - 1)
    rows = [[] for _ in range(1 + max(level.values(), default=0))]
    for n, y in level.items():
        rows[y].append(n)
    return [r for r in rows if r]


def _draw_one(ax, placed, pos, engine_of):
    for i, j in placed.edges:
        (x0, y0), (x1, y1) = pos[i], pos[j]
        ax.plot([x0, x1], [y0, y1], color="#cccccc", linewidth=0.5, zorder=1)
    device = [n for n, node in enumerate(placed.nodes) if node["partition"] is not None]
    host = [n for n, node in enumerate(placed.nodes) if node["partition"] is None]
    ax.scatter([pos[n][0] for n in device], [pos[n][1] for n in device], s=14, zorder=2,
               c=[colour(engine_of(placed.nodes[n]["partition"])) for n in device])
    ax.scatter([pos[n][0] for n in host], [pos[n][1] for n in host], s=60, marker="X", c=HOST, zorder=3)
    if len(placed.nodes) <= 80:     # small graphs: every op named
        for n in device:
            ax.annotate(placed.nodes[n]["op"].split("::")[-1].split(".")[0], pos[n], fontsize=6, color="#555555",
                        xytext=(5, -2), textcoords="offset points", zorder=4)
    for n in host:
        ax.annotate(placed.nodes[n]["op"].split("::")[-1], pos[n], fontsize=7, color=HOST,
                    xytext=(5, -2), textcoords="offset points", zorder=4)
    starts = {}
    for n, node in enumerate(placed.nodes):
        starts.setdefault(node["partition"], n)
    for pid, n in starts.items():
        if pid is not None:
            ax.annotate(f"P{pid} {engine_of(pid)}", pos[n], fontsize=7, xytext=(-8, 6),
                        textcoords="offset points", color=colour(engine_of(pid)), zorder=4)
    ax.set_title(f"{placed.name}\n{placed.total_ops} ops, {placed.host_ops} on the host", fontsize=8)
    ax.axis("off")


def _legend(plt, engines):
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker="o", linestyle="", color=colour(e), label=e) for e in sorted(filter(None, engines))]
    handles.append(Line2D([], [], marker="X", linestyle="", color=HOST, label="host (PyTorch)"))
    return handles


_PARTITION = re.compile(r"partition (\d+) \((\w+)\)")


def latency_chart(spans, eager_ms, kiln_ms, path: str) -> str:
    """Horizontal bars: milliseconds per call in each partition and host op (kiln's profiler
    spans), with eager PyTorch's and kiln's whole-call times for scale."""
    plt = _pyplot()
    shown = spans[:25]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.32 * max(len(shown), 1)))
    names = [s["name"] for s in shown][::-1]
    values = [s["ms"] for s in shown][::-1]
    colours = []
    for s in shown[::-1]:
        m = _PARTITION.match(s["name"])
        colours.append(HOST if s["kind"] == "host" else colour(m.group(2) if m else None))
    ax.barh(names, values, color=colours)
    for y, v in enumerate(values):
        ax.annotate(f"{v:.3f} ms", (v, y), xytext=(3, -3), textcoords="offset points", fontsize=7)
    if eager_ms:
        ax.axvline(eager_ms, color="black", linestyle="--", linewidth=1, label=f"eager call {eager_ms:.3f} ms")
    if kiln_ms:
        ax.axvline(kiln_ms, color="#2ca02c", linestyle=":", linewidth=1.5, label=f"kiln call {kiln_ms:.3f} ms")
    ax.set_xlabel("ms per call")
    ax.set_title("where a call's time goes (kiln's profiler spans)", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
