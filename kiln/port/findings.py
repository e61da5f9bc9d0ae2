"""Blockers, their fixes, and the tier they put a model in.

The seeds' three tiers, by kiln's own facts:

* **tier 1** — one clean capture, every operation on an engine: ``kiln.trace`` and go;
* **tier 2** — it runs, with work: ops on the host (PyTorch fallback), graph breaks,
  data-dependent control flow or output shapes, shapes that need buckets, ops to substitute;
* **tier 3** — custom or non-ATen kernels no engine has an equivalent for: they run on the
  host only, and putting them on an engine means writing the kernel (NKI's place on Neuron).

Each blocker carries the user's source line where one is known and a concrete fix.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

TIER_TEXT = {1: "compiles as is (every op on an engine, one clean graph)",
             2: "runs, with work (host fallback, graph breaks, data-dependent code or shapes)",
             3: "needs a kernel (custom or non-ATen ops no engine runs)"}

# ATen ops no engine takes, and how to say them with ops every engine runs
SUBSTITUTIONS = {
    "median": "x.sort(dim).values.select(dim, (x.shape[dim] - 1) // 2) (torch.median's lower median), "
              "or .narrow for keepdim",
    "kthvalue": "x.sort(dim).values.select(dim, k - 1)",
    "bucketize": "(x.unsqueeze(-1) > boundaries).sum(-1) (right=False; >= for right=True)",
    "searchsorted": "(values.unsqueeze(-1) > sorted_sequence).sum(-1) for a 1-D sorted sequence (side='left')",
    "_fft_r2c": "a real DFT as two matmuls with cos/sin tables (x @ C, x @ S): engines have no complex dtype",
    "_fft_c2r": "the inverse real DFT as matmuls with cos/sin tables",
    "_linalg_eigh": "no ATen substitute: keep it on the host, or precompute it outside the model",
    "_linalg_svd": "no ATen substitute: keep it on the host, or precompute it outside the model",
    "linalg_cholesky_ex": "no ATen substitute: keep it on the host, or precompute it outside the model",
    "nonzero": "a mask instead of indices: torch.where(mask, x, 0) keeps the shape static",
    "masked_select": "torch.where(mask, x, 0) and a sum/count, which keeps the shape static",
    "unique": "a fixed-size result (torch.bincount with minlength, or a one-hot sum) keeps the shape static",
}


@dataclass
class Blocker:
    kind: str            # host-op | custom-op | graph-break | data-dependent | dynamic-shape | capture | compile | validation
    tier: int
    what: str
    where: str | None
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def tier_of(blockers) -> int:
    return max([1, *(b.tier for b in blockers)])


def from_capture_error(message: str) -> Blocker:
    """``kiln.graph.capture``'s CaptureError text: why, the user's line, the fix."""
    where = re.search(r"\n\s*at (.+)", message)
    fix = re.search(r"\n\s*fix: (.+)", message)
    why = message.split("\n")[0]
    kind = "data-dependent" if "data-dependent" in message else "capture"
    return Blocker(kind, 2, why, where.group(1).strip() if where else None,
                   fix.group(1).strip() if fix else "see torch.export.export(model, args) for the full report")


_BREAKS = (
    ("data-dependent", ("generic_jump", "data-dependent jump", "Data-dependent"),
     "a Python branch on a tensor's value (data-dependent control flow) splits the graph",
     "compute both sides and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, "
     "operands); a value known ahead of time can be a Python constant"),
    ("dynamic-shape", ("Dynamic shape operator", "dynamic shape"),
     "an op whose output shape depends on values (nonzero, unique, masked_select)",
     "keep shapes static: a mask instead of indices (torch.where(mask, x, 0)), a fixed-size result"),
    ("graph-break", ("Tensor.item", ".item()"),
     "a tensor's value is read into Python (.item(), int(t), float(t))",
     "keep the value a tensor (use it in tensor ops), or set torch._dynamo.config.capture_scalar_outputs = "
     "True and bound it with torch._check"),
    ("graph-break", ("print", "logging", "builtin", "call_function", "Unsupported"),
     "a call Dynamo cannot trace (print, logging, numpy, an untraceable builtin or library)",
     "move the call out of forward(), or wrap it in torch.compiler.disable where it must stay"),
)


def from_breaks(breaks) -> list:
    out = []
    for b in breaks:
        kind, what = "graph-break", f"graph break: {b.reason}"
        fix = ("move the untraceable code out of forward() or rewrite it in torch operations; "
               "torch._dynamo.explain(model)(*args) lists them")
        for k, keys, plain, remedy in _BREAKS:
            if any(key in b.reason for key in keys):
                kind, what, fix = k, f"graph break: {plain} ({b.reason})", remedy
                break
        out.append(Blocker(kind, 2, what, b.where, fix))
    return out


def merge(blockers) -> list:
    """One blocker per kind and line: a graph's own finding (with the op's substitution)
    replaces Dynamo's break at the same line, which says less."""
    kept = {}
    for b in blockers:
        key = (b.kind, b.where or b.what)
        old = kept.get(key)
        if old is None or (old.what.startswith("graph break") and not b.what.startswith("graph break")):
            kept[key] = b
    return list(kept.values())


def host_op(op: str, reason: str, count: int, where: str | None, engine_unsupported: bool) -> Blocker:
    """An operation the engines leave to PyTorch on the host."""
    namespace = op.split("::")[0] if "::" in op else "aten"
    short = op.split("::")[-1].split(".")[0]
    times = f" ({count}×)" if count > 1 else ""
    if namespace not in ("aten", "prims"):
        return Blocker("custom-op", 3, f"{op}{times} is a custom (non-ATen) op no engine runs: {reason}", where,
                       "it runs on the host through PyTorch; to put it on an engine, write its body in torch "
                       "operations (a registered decomposition or a plain function) or add a kernel for it")
    if not engine_unsupported:
        return Blocker("host-op", 2, f"{op}{times} is on the host: {reason}", where,
                       "an option put it there (ops_on_host, min_partition_size); drop the option to put it back")
    sub = SUBSTITUTIONS.get(short)
    fix = (f"substitute: {sub}" if sub else
           "it runs on the host through PyTorch, one device/host round trip each call; rewrite it with "
           "ops the engines run, or try engine='inductor', which runs most ATen ops")
    return Blocker("host-op", 2, f"{op}{times} has no engine kernel: {reason}", where, fix)


def dynamic_shape(op: str, where: str | None) -> Blocker:
    short = op.split("::")[-1].split(".")[0]
    sub = SUBSTITUTIONS.get(short, "an op whose output shape does not depend on values (a mask, a fixed size)")
    return Blocker("dynamic-shape", 2, f"{op}'s output shape depends on the input's values", where,
                   f"substitute: {sub}")
