"""Validation gate: compiled outputs against eager PyTorch on the example inputs."""
from __future__ import annotations

import torch

from .errors import ValidationError


def compare(expected: list, actual: list, names: list, atol: float, rtol: float) -> dict:
    """Error metrics per output and overall; raises ValidationError beyond atol/rtol."""
    per_output = []
    failures = []
    for name, e, a in zip(names, expected, actual):
        if e.shape != a.shape:
            failures.append(f"output '{name}': shape {tuple(a.shape)} != eager {tuple(e.shape)}")
            continue
        if not e.is_floating_point():
            ok = torch.equal(e, a.to(e.dtype))
            per_output.append({"name": name, "exact": ok})
            if not ok:
                failures.append(f"output '{name}': integer outputs differ from eager")
            continue
        e64, a64 = e.double(), a.double()
        diff = (e64 - a64).abs()
        max_abs = diff.max().item() if diff.numel() else 0.0
        denom = e64.abs().clamp_min(1e-12)
        max_rel = (diff / denom)[diff > atol].max().item() if (diff > atol).any() else 0.0
        cos = torch.nn.functional.cosine_similarity(e64.flatten(), a64.flatten(), dim=0).item() \
            if e.numel() else 1.0
        ok = torch.allclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True)
        per_output.append({"name": name, "max_abs_error": max_abs, "max_rel_error": max_rel,
                           "cosine_similarity": cos, "within_tolerance": ok})
        if not ok:
            failures.append(f"output '{name}': max abs error {max_abs:.3g}, max rel error "
                            f"{max_rel:.3g}, cosine similarity {cos:.6f}")
    floats = [p for p in per_output if "max_abs_error" in p]
    summary = {
        "atol": atol, "rtol": rtol, "passed": not failures,
        "max_abs_error": max((p["max_abs_error"] for p in floats), default=0.0),
        "max_rel_error": max((p["max_rel_error"] for p in floats), default=0.0),
        "min_cosine_similarity": min((p["cosine_similarity"] for p in floats), default=1.0),
        "outputs": per_output,
    }
    if failures:
        raise ValidationError(
            "compiled model does not match eager PyTorch within atol={:g}, rtol={:g}:\n  {}\n"
            "Loosen atol/rtol if this precision is acceptable, or pass validate=False".format(
                atol, rtol, "\n  ".join(failures)), summary)
    return summary
