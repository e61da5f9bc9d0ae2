"""Help text and argument types more than one ``kiln`` command shares, so the flags read the same everywhere."""
from kiln.argtypes import non_negative_seconds, positive_int, positive_seconds  # noqa: F401 - the commands' types

TRUST_HELP = ("load native code (TorchInductor partitions) from an artifact that no key trusted here "
              "signed (as KILN_TRUST_NATIVE_CODE=1); only for artifacts from a source you trust")


def validation_line(v: dict) -> str:
    """One line for a manifest's ``validation``, in either of its two forms: the comparison
    with eager at a tolerance (exact compiles) or the accuracy gate (quantized and
    auto-cast compiles, :func:`kiln.graph.validation.quality_gate`, with the largest
    difference of the example's outputs added)."""
    if "min_cosine" in v:
        line = (f"accuracy gate {'passed' if v.get('passed') else 'FAILED'}: cosine {v['min_cosine']:.6f} "
                f"(min {v.get('min_cosine_threshold')}) over {v.get('samples')} input(s)")
        if "top1_agreement" in v:
            line += f", top-1 agreement {v['top1_agreement']:.2%} (min {v.get('min_top1_threshold'):.0%})"
        if "max_abs_error" in v:
            line += f", max abs error {v['max_abs_error']:.3g}"
        return line
    line = (f"max abs error {v['max_abs_error']:.3g}, max rel {v['max_rel_error']:.3g}, "
            f"cosine {v['min_cosine_similarity']:.6f} (atol {v['atol']}, rtol {v['rtol']})")
    return line + (f", at {v['precision']} precision" if v.get("precision") else "")


def print_notes(manifest, console):
    """The compile's notes (what stayed on the host or in float, what was emulated, ...), as
    ``kiln analyze`` prints its own: they were in the manifest only, seen with --json."""
    for note in manifest.get("report", {}).get("notes", []):
        console.print(f"[yellow]note:[/] {note}", highlight=False)
