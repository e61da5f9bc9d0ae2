"""Analysis: which ops an engine supports, where the rest come from, how the graph splits."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kiln.graph.partition import describe_node, is_compute, op_name


@dataclass
class AnalysisReport:
    model_name: str
    engine: str
    total_ops: int
    supported_ops: dict                     # op -> count (on the device)
    unsupported_ops: list                   # [{op, count, reason, locations}]
    partitions: list                        # [{id, num_ops, ops}]
    host_ops: int
    notes: list = field(default_factory=list)

    @property
    def support_percentage(self) -> float:
        if not self.total_ops:
            return 100.0
        return 100.0 * sum(self.supported_ops.values()) / self.total_ops

    def to_dict(self) -> dict:
        return {
            "model_name": self.model_name,
            "engine": self.engine,
            "support_percentage": round(self.support_percentage, 2),
            "total_ops": self.total_ops,
            "supported_ops": dict(self.supported_ops),
            "unsupported_ops": self.unsupported_ops,
            "partitions": self.partitions,
            "host_ops": self.host_ops,
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        lines = [f"{self.model_name} on {self.engine}: {self.support_percentage:.1f}% of all operations "
                 f"({sum(self.supported_ops.values())} of {self.total_ops}) are supported; "
                 f"{len(self.partitions)} device partition(s), {self.host_ops} op(s) on the host"]
        for op, n in sorted(self.supported_ops.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  device  {n:5d}  {op}")
        for u in self.unsupported_ops:
            lines.append(f"  host    {u['count']:5d}  {u['op']}: {u['reason']}")
            for loc in u["locations"][:3]:
                lines.append(f"                 at {loc}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def report(gm, placement, model_name, engine) -> AnalysisReport:
    supported: Counter = Counter()
    unsupported: dict = {}
    total = 0
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        total += 1
        name = op_name(node.target)
        if placement.on_device.get(node):
            supported[name] += 1
            continue
        reason = placement.reasons.get(node, "runs on the host")
        entry = unsupported.setdefault((name, reason), {
            "op": name, "count": 0, "reason": reason, "locations": [],
            # False: the engine could run it, but options or partition size kept it on the host
            "engine_unsupported": node in placement.unsupported})
        entry["count"] += 1
        loc = describe_node(node)["location"]
        if loc and loc not in entry["locations"]:
            entry["locations"].append(loc)
    parts = []
    for i, nodes in enumerate(placement.partitions):
        ops = Counter(op_name(n.target) for n in nodes if is_compute(n))
        parts.append({"id": i, "num_ops": sum(ops.values()), "ops": dict(ops)})
    host = total - sum(supported.values())
    return AnalysisReport(model_name, engine, total, dict(supported), list(unsupported.values()),
                          parts, host)
