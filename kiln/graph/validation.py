"""Validation gate: compiled outputs against eager PyTorch on the example inputs."""
from __future__ import annotations

import torch

from kiln.errors import ValidationError


def rtol_floor(dtype) -> float:
    """The tightest relative tolerance an output of ``dtype`` can be held to: two units
    in the last place for bf16 and fp16 (as ``torch.testing`` allows bf16 1.6e-2). Two
    correct engines computing a bf16 graph round differently, by an ulp (0.8 % in bf16)
    or two; rtol=1e-3 on a bf16 output would reject every engine but eager itself."""
    return 2 * torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else 0.0


def narrowest_float(gm) -> torch.dtype | None:
    """bf16 or fp16 when some value of the graph ``gm`` has that dtype (an auto-cast
    graph's convolutions, say), else None: its fp32 outputs then carry those roundings
    too (batch norm's statistics of a bf16 convolution's output)."""
    found = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype in (torch.bfloat16, torch.float16):
            found.add(val.dtype)
    return torch.bfloat16 if torch.bfloat16 in found else next(iter(found), None)


def compare(expected: list, actual: list, names: list, atol: float, rtol: float,
            computed_in: torch.dtype | None = None) -> dict:
    """Error metrics per output and overall; raises ValidationError beyond atol/rtol.
    For outputs in bf16 or fp16, and all outputs of a graph ``computed_in`` one of them,
    rtol is no tighter than :func:`rtol_floor` and atol no tighter than that floor times
    the output's largest magnitude (as kiln's batching check holds bf16 outputs)."""
    floor = rtol_floor(computed_in) if computed_in is not None else 0.0
    per_output = []
    failures = []
    for name, e, a in zip(names, expected, actual):
        if e.shape != a.shape:
            failures.append(f"output '{name}': shape {tuple(a.shape)} != eager {tuple(e.shape)}")
            continue
        if e.dtype != a.dtype and (e.is_floating_point() or a.is_floating_point()):
            # an engine follows the graph's metadata; where PyTorch's dtype rules disagree
            # with its CPU kernels (batch norm's statistics of a bf16 input: bf16 by the
            # rules, fp32 from the kernel), the compiled model would hand on another dtype
            failures.append(f"output '{name}': dtype {str(a.dtype).replace('torch.', '')}, eager gives "
                            f"{str(e.dtype).replace('torch.', '')}")
            per_output.append({"name": name, "dtype": str(a.dtype), "eager_dtype": str(e.dtype)})
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
        narrow_floor = max(floor, rtol_floor(e.dtype))
        r, a_tol = max(rtol, narrow_floor), atol
        if narrow_floor and e.numel():
            # a sum of many bf16 terms is good to a few ulps of the terms' size, not of
            # the result's: near zero only a tolerance of the output's scale holds
            a_tol = max(atol, narrow_floor * e64.abs().nan_to_num(0, 0, 0).max().item())
        ok = torch.allclose(a64, e64, rtol=r, atol=a_tol, equal_nan=True)
        per_output.append({"name": name, "max_abs_error": max_abs, "max_rel_error": max_rel,
                           "cosine_similarity": cos, "within_tolerance": ok})
        if r != rtol:
            per_output[-1].update(rtol=r, atol=a_tol)
        if not ok:
            narrow = computed_in if floor >= rtol_floor(e.dtype) else e.dtype
            held = (f" (rtol {r:g}, atol {a_tol:.3g}: {str(narrow).replace('torch.', '')})"
                    if r != rtol else "")
            failures.append(f"output '{name}'{held}: max abs error {max_abs:.3g}, max rel error "
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


def quality_gate(samples: list, min_cosine: float, min_top1: float, label: str) -> dict:
    """Gate for lossy compilation (int8, reduced precision) over several inputs.

    ``samples`` is a list of (expected outputs, actual outputs) pairs. Cosine
    similarity is taken per sample over all float outputs together; top-1
    agreement is checked for classifier-shaped outputs (the first float output
    being [batch, classes]).
    """
    cosines, agree, total = [], 0, 0
    for expected, actual in samples:
        fe = [e.double().flatten() for e in expected if e.is_floating_point()]
        fa = [a.double().flatten() for e, a in zip(expected, actual) if e.is_floating_point()]
        if not fe:
            continue
        cosines.append(torch.nn.functional.cosine_similarity(torch.cat(fe), torch.cat(fa), dim=0).item())
        first = next(i for i, e in enumerate(expected) if e.is_floating_point())
        e, a = expected[first], actual[first]
        if e.dim() == 2 and e.shape[1] > 1:
            agree += int((e.argmax(1) == a.argmax(1)).sum())
            total += e.shape[0]
    result = {"samples": len(cosines), "min_cosine": min(cosines, default=1.0),
              "mean_cosine": sum(cosines) / max(1, len(cosines)), "min_cosine_threshold": min_cosine}
    failures = []
    if result["min_cosine"] < min_cosine:
        # enough digits that a value just under a strict threshold does not read as 1.000000
        failures.append(f"cosine similarity {result['min_cosine']:.10g} < {min_cosine} "
                        f"(mean {result['mean_cosine']:.10g} over {len(cosines)} inputs)")
    if total:
        result["top1_agreement"] = agree / total
        result["min_top1_threshold"] = min_top1
        if agree / total < min_top1:
            failures.append(f"top-1 agreement {agree / total:.4f} < {min_top1} ({agree}/{total})")
    result["passed"] = not failures
    if failures:
        raise ValidationError(f"{label} fails the accuracy gate against fp32 eager: "
                              + "; ".join(failures) + ". Lower min_cosine/min_top1 if this is "
                              "acceptable, calibrate with more representative data, or compile "
                              "without it", result)
    return result
