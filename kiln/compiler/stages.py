"""Stage planning: cut one model's graph into N pipeline stages of balanced cost.

Neuron's ``--neuroncore-pipeline-cores N``. The graph is timed node by node on the
example inputs, cut where the fewest tensors cross and the costs balance, and each
stage is compiled through the driver's ``trace_one``. The runtime that streams
requests through the stages is :class:`kiln.runtime.stages.Pipeline`.
"""
from __future__ import annotations

import operator
import re
import statistics
import time

import numpy as np
import torch

from kiln.artifact.container import wrapper_manifest
from kiln.errors import CompilerArgsError
from kiln.host import cores as placement
from kiln.runtime.stages import Pipeline, stage_cores


# Node costs are wall-clock times on a possibly busy machine; cuts whose slowest
# stage is within this fraction of the best one are treated as equally fast, so
# the tie-break (fewer tensors crossing) decides between them.
TIE_MARGIN = 0.03


_COMPUTE = ("call_function", "call_module", "call_method")


# -- compile -----------------------------------------------------------------------------
def trace_pipeline(model, example_inputs, example_kwargs, n, trace_one, progress) -> "Pipeline":
    """Capture, time, split and compile ``model`` into an ``n``-stage ``Pipeline``."""
    from kiln.graph.capture import capture
    n = int(n)
    visible = stage_cores(n, "compile a pipeline of")
    started = time.perf_counter()
    progress.label = "kiln pipeline"
    progress.timings = {}
    with progress.phase("capture"):
        captured = capture(model, example_inputs, example_kwargs)
    gm = captured.graph_module
    with progress.phase("profile"):
        costs, values = profile(gm, captured.example_inputs, threads=len(visible[0].cpus))
    with progress.phase("split"):
        units = _units(gm)
        if len(units) < n:
            raise CompilerArgsError(
                f"{captured.model_name} has {len(units)} operator(s), too few to split over "
                f"{n} pipeline cores; use at most {len(units)} or do not pipeline it")
        unit_costs = [sum(costs.get(v, 0.0) for v in u) for u in units]
        crossing, valid = _cut_info(units, values)
        bounds = partition(unit_costs, crossing, valid, n)
        plan = _plan_stages(gm, units, bounds, captured.model_name)
        stage_inputs = _run_split(plan, captured.example_inputs, threads=len(visible[0].cpus))
    phases = dict(progress.timings)

    total = sum(unit_costs) or 1.0
    stages, records = [], []
    for k, st in enumerate(plan["stages"]):
        t0 = time.perf_counter()
        with placement.cores(k):   # compiled straight onto its core: no second engine load
            stages.append(trace_one(st["module"], tuple(stage_inputs[k]), None,
                                    label=f"stage {k + 1}/{n}"))
        stage_cost = sum(unit_costs[bounds[k]:bounds[k + 1]])
        records.append({
            "blob": f"stages/{k}.kiln",
            "inputs": st["inputs"],
            "num_outputs": len(st["outputs"]),
            "nodes": st["nodes"],
            "cost_share": round(stage_cost / total, 4),
            "cost_ms": round(stage_cost * 1e3, 4),
            "crossing_in": crossing[bounds[k]] if k else 0,
            "compile_seconds": round(time.perf_counter() - t0, 3),
        })
    meta = {"stages": records, "outputs": plan["outputs"],
            "profile": {"total_ms": round(total * 1e3, 4), "threads": len(visible[0].cpus),
                        "runs": 3, "tie_margin": TIE_MARGIN}}
    manifest = _manifest(captured, stages, meta)
    pipe = Pipeline(stages, manifest)

    opts = stages[0].manifest.get("compile_options", {})
    progress.label = "kiln pipeline"
    progress.timings = {}
    with progress.phase("validate"):
        manifest["validation"] = _validate(pipe, captured, opts)
    phases.update(progress.timings)
    phases["stages"] = round(sum(r["compile_seconds"] for r in records), 3)
    manifest["phases"] = {k: round(v, 3) for k, v in phases.items()}
    manifest["compile_seconds"] = round(time.perf_counter() - started, 3)
    return pipe


# -- measuring -----------------------------------------------------------------------------
class _Timer(torch.fx.Interpreter):
    """Times only the operator call, not the interpreter's argument lookup, which
    would otherwise make free ops (views) look as costly as small matmuls."""

    def __init__(self, gm, times):
        super().__init__(gm, garbage_collect_values=False)
        self.times = times
        self._node = None

    def run_node(self, n):
        self._node = n
        return super().run_node(n)

    def _timed(self, call, target, args, kwargs):
        t0 = time.perf_counter()
        result = call(target, args, kwargs)
        self.times.setdefault(self._node, []).append(time.perf_counter() - t0)
        return result

    def call_function(self, target, args, kwargs):
        return self._timed(super().call_function, target, args, kwargs)

    def call_module(self, target, args, kwargs):
        return self._timed(super().call_module, target, args, kwargs)

    def call_method(self, target, args, kwargs):
        return self._timed(super().call_method, target, args, kwargs)


def profile(gm, example_inputs, threads=None, runs=3):
    """({node: median seconds}, {node: value}) over ``runs`` timed runs after a warm-up.

    Timed with as many intra-op threads as one stage's core has, since that is
    what each stage will run with; relative costs shift with the thread count."""
    times: dict = {}
    with _threads(threads), torch.no_grad():
        _Timer(gm, {}).run(*example_inputs)                  # warm-up: allocator, caches
        for _ in range(runs):
            timer = _Timer(gm, times)
            timer.run(*example_inputs)
    return {node: statistics.median(ts) for node, ts in times.items()}, timer.env


class _threads:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


# -- splitting ---------------------------------------------------------------------------------
def _units(gm) -> list:
    """The graph's compute nodes as indivisible groups, in topological order.

    A group is one op plus the ``getitem``s unpacking it (a stage can only
    hand on tensors, not tuples) and the constant-only ops feeding it, such as
    a weight's transpose: those must stay with their consumer, or the next
    stage would receive the weight as a runtime input its engine cannot
    pre-pack, and the cut would look more expensive than it is."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    const: set = set()
    units, where = [], {}
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE:
            continue
        inputs = node.all_input_nodes
        if node.op == "call_function" and all(a.op == "get_attr" or a in const for a in inputs):
            const.add(node)
            continue
        src = node.args[0] if node.args else None
        if (node.op == "call_function" and node.target is operator.getitem
                and isinstance(src, torch.fx.Node) and src in where):
            units[where[src]].append(node)
            where[node] = where[src]
            continue
        where[node] = len(units)
        units.append([node])
    if not units:
        return [sorted(const, key=order.get)] if const else []
    for node in sorted(const, key=order.get, reverse=True):   # consumers first
        users = [where[u] for u in node.users if u in where]
        where[node] = min(users) if users else len(units) - 1
        units[where[node]].append(node)
    return [sorted(u, key=order.get) for u in units]


def _cut_info(units, values):
    """For each cut position p (between unit p-1 and unit p): how many values
    cross it, and whether all of them are tensors (anything else cannot be a
    stage's output)."""
    m = len(units)
    where = {v: u for u, unit in enumerate(units) for v in unit}
    cross = np.zeros(m + 2, dtype=np.int64)
    bad = np.zeros(m + 2, dtype=np.int64)
    for u, unit in enumerate(units):
        for v in unit:
            last = max((where[us] for us in v.users if us in where), default=u)
            if last <= u:
                continue
            target = cross if isinstance(values.get(v), torch.Tensor) else bad
            target[u + 1] += 1
            target[last + 1] -= 1
    crossing = [int(c) for c in np.cumsum(cross)[:m + 1]]
    valid = [bool(b == 0) for b in np.cumsum(bad)[:m + 1]]
    valid[0] = valid[m] = False   # not cuts: every stage needs at least one unit
    return crossing, valid


def partition(costs, crossing, valid, n, margin=TIE_MARGIN) -> list:
    """Stage boundaries ``[0, b1, ..., m]`` over units with ``costs``.

    First the smallest achievable slowest-stage cost B (exact linear-partition
    DP); then, among cuts whose slowest stage is within ``margin`` of B, the one
    with the fewest crossing tensors (summed over cuts), then the fastest. Both
    are DPs because (sum of crossings, max cost) combines monotonically."""
    m = len(costs)
    if n == 1:
        return [0, m]
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    ok = np.asarray(valid, dtype=bool)
    cut_w = np.asarray(crossing, dtype=np.float64)
    idx = np.arange(m + 1)

    # 1. the best bottleneck
    f = pre.copy()
    f[0] = np.inf
    for k in range(2, n + 1):
        g = np.full(m + 1, np.inf)
        for j in (range(k, m + 1) if k < n else (m,)):
            cand = np.where(ok[:j] & (idx[:j] >= k - 1), np.maximum(f[:j], pre[j] - pre[:j]), np.inf)
            g[j] = cand.min()
        f = g
    best = f[m]
    if not np.isfinite(best):
        raise CompilerArgsError(
            f"the graph cannot be cut into {n} stages: every cut would pass a non-tensor value "
            "between stages; use fewer pipeline cores")

    # 2. fewest crossings among near-best cuts
    limit = best * (1.0 + margin) + 1e-12
    cross = np.where((pre <= limit) & (idx >= 1), 0.0, np.inf)
    worst = np.where(np.isfinite(cross), pre, np.inf)
    back = [None] * (n + 1)
    for k in range(2, n + 1):
        nc, nw = np.full(m + 1, np.inf), np.full(m + 1, np.inf)
        arg = np.full(m + 1, -1, dtype=np.int64)
        for j in (range(k, m + 1) if k < n else (m,)):
            span = pre[j] - pre[:j]
            feasible = ok[:j] & (idx[:j] >= k - 1) & np.isfinite(cross[:j]) & (span <= limit)
            if not feasible.any():
                continue
            c = np.where(feasible, cross[:j] + cut_w[:j], np.inf)
            w = np.where(feasible, np.maximum(worst[:j], span), np.inf)
            fewest = c.min()
            i = int(np.argmin(np.where(c == fewest, w, np.inf)))
            nc[j], nw[j], arg[j] = c[i], w[i], i
        cross, worst, back[k] = nc, nw, arg
    bounds = [m]
    for k in range(n, 1, -1):
        bounds.append(int(back[k][bounds[-1]]))
    bounds.append(0)
    return bounds[::-1]


def _plan_stages(gm, units, bounds, model_name) -> dict:
    """One GraphModule per stage plus the wiring, as JSON-able references:
    ``["input", i]`` (the model's i-th flat input) or ``["stage", k, j]``
    (stage k's j-th output)."""
    n = len(bounds) - 1
    stage_of = {}
    for k in range(n):
        for unit in units[bounds[k]:bounds[k + 1]]:
            for v in unit:
                stage_of[v] = k
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    input_index = {p: i for i, p in enumerate(placeholders)}
    out_node = next(o for o in gm.graph.nodes if o.op == "output")
    final = list(out_node.args[0])

    members = [[v for unit in units[bounds[k]:bounds[k + 1]] for v in unit] for k in range(n)]
    outputs = []
    for k in range(n):
        outs = [v for v in members[k]
                if any(us.op == "output" or stage_of.get(us, -1) > k for us in v.users)]
        if k == n - 1:   # constants returned as outputs come out of the last stage
            outs += [v for v in dict.fromkeys(final) if v.op == "get_attr"]
        outputs.append(outs)
    out_pos = [{v: j for j, v in enumerate(outs)} for outs in outputs]

    def ref(v):
        if v in input_index:
            return ["input", input_index[v]]
        k = stage_of.get(v, n - 1)
        return ["stage", k, out_pos[k][v]]

    stages = []
    for k in range(n):
        ins, attrs = {}, {}
        for v in members[k]:
            for a in v.all_input_nodes:
                if a.op == "get_attr":
                    attrs[a] = None
                elif a.op == "placeholder" or stage_of[a] != k:
                    ins[a] = None
        attrs.update((v, None) for v in outputs[k] if v.op == "get_attr")
        module = _stage_module(gm, list(ins), list(attrs), members[k], outputs[k],
                               f"{_identifier(model_name)}_stage{k + 1}")
        stages.append({"module": module, "inputs": [ref(a) for a in ins], "outputs": outputs[k],
                       "nodes": sum(1 for v in members[k] if v.target is not operator.getitem)})
    return {"stages": stages, "outputs": [ref(v) for v in final]}


def _stage_module(gm, inputs, attrs, nodes, outputs, class_name):
    """A standalone GraphModule for one stage, owning the weights it uses, so it
    captures and compiles like any model."""
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict = {}
    names: dict = {}

    def own(target):
        if target not in names:
            name = _identifier(target)
            while hasattr(root, name):
                name += "_"
            value = _fetch(gm, target)
            if isinstance(value, torch.nn.Module):
                root.add_module(name, value)
            elif isinstance(value, torch.Tensor):
                root.register_buffer(name, value.detach())
            else:
                setattr(root, name, value)
            names[target] = name
        return names[target]

    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a in attrs:
        env[a] = graph.get_attr(own(a.target))
    for v in nodes:
        env[v] = graph.node_copy(v, lambda x: env[x])
        if v.op == "call_module":
            env[v].target = own(v.target)
    graph.output(tuple(env[v] for v in outputs))
    return torch.fx.GraphModule(root, graph, class_name=class_name)


def _identifier(text) -> str:
    name = re.sub(r"\W", "_", str(text))
    return name if name and not name[0].isdigit() else f"_{name}"


def _fetch(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _run_split(plan, example_inputs, threads=None) -> list:
    """Run the stage modules in PyTorch, in order, for each stage's example inputs
    (and to prove the wiring before anything is compiled)."""
    produced: list = []
    stage_inputs = []
    with _threads(threads), torch.no_grad():
        for st in plan["stages"]:
            ins = [_resolve(r, example_inputs, produced) for r in st["inputs"]]
            stage_inputs.append(ins)
            produced.append(list(st["module"](*ins)))
    return stage_inputs


def _resolve(ref, inputs, produced):
    return inputs[ref[1]] if ref[0] == "input" else produced[ref[1]][ref[2]]


def _manifest(captured, stages, meta) -> dict:
    first = stages[0].manifest
    outer = {"model_name": captured.model_name, "target": first.get("target", {}),
             "inputs": {"args": captured.arg_names, "structure": captured.input_structure,
                        "positional": captured.positional,
                        "tensors": [s.to_dict() for s in captured.input_specs]},
             "outputs": {"structure": captured.output_structure,
                         "tensors": [s.to_dict() for s in captured.output_specs]},
             "report": _merge_reports(captured.model_name, [s.manifest.get("report") for s in stages])}
    return wrapper_manifest("pipeline", outer, pipeline=meta, engine=first.get("engine"),
                            compile_options=first.get("compile_options"),
                            torch_version=torch.__version__, created=first.get("created"))


def _merge_reports(model_name, reports) -> dict | None:
    """One op-support report over all stages, so tools reading ``report`` work as
    for a single compiled model."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    supported: dict = {}
    unsupported: dict = {}
    partitions, notes = [], []
    for k, r in enumerate(reports):
        for op, c in r.get("supported_ops", {}).items():
            supported[op] = supported.get(op, 0) + c
        for u in r.get("unsupported_ops", []):
            if u["op"] in unsupported:
                unsupported[u["op"]]["count"] += u["count"]
            else:
                unsupported[u["op"]] = dict(u)
        partitions += [dict(p, stage=k) for p in r.get("partitions", [])]
        notes += [f"stage {k + 1}: {note}" for note in r.get("notes", [])]
    total = sum(r.get("total_ops", 0) for r in reports)
    return {"model_name": model_name, "engine": reports[0].get("engine"),
            "support_percentage": round(100.0 * sum(supported.values()) / total, 2) if total else 100.0,
            "total_ops": total, "supported_ops": supported,
            "unsupported_ops": list(unsupported.values()), "partitions": partitions,
            "host_ops": sum(r.get("host_ops", 0) for r in reports), "notes": notes}


def _validate(pipe, captured, opts) -> dict:
    """End-to-end check of the wired stages against eager PyTorch.

    Each stage was validated on its own; this catches wiring mistakes and error
    growth across stages. Lossy compiles (int8, auto-cast) passed their own
    accuracy gates per stage, so for them the error is recorded, not judged."""
    from kiln.graph import randomness
    from kiln.graph.validation import compare
    randomness.restore(captured.draws)
    actual = pipe.run_flat(list(captured.example_inputs))
    names = [s.name for s in captured.output_specs]
    lossy = opts.get("quantize") or opts.get("auto_cast", "none") != "none"
    if opts.get("validate", True) and not lossy:
        return compare(captured.eager_outputs, actual, names, opts.get("atol", 1e-3), opts.get("rtol", 1e-3))
    summary = compare(captured.eager_outputs, actual, names, float("inf"), 0.0)   # metrics only
    summary.update(atol=None, rtol=None, passed=None, judged=False)
    return summary
