"""Help text and argument types more than one ``kiln`` command shares, so the flags read the same everywhere."""
import argparse
import math

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


def positive_int(text) -> int:
    """An argparse type for counts (threads, rows, tokens, workers): a bad one fails at parse
    time with the usage line, before a model is loaded, instead of deep in a compile or
    silently as one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text) -> float:
    """An argparse type for periods and durations: a finite number above 0 (``--period 0``
    exited with status 1 from inside the command, or was taken, and busy-looped, by ``kiln top``;
    ``kiln bench --duration nan`` measured forever and ``kiln monitor --period inf`` was an
    OverflowError traceback)."""
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def non_negative_seconds(text) -> float:
    """An argparse type for waits that may be 0 (a warm-up): a finite number, not below 0."""
    value = _seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be below 0 seconds, got {text}")
    return value


def _seconds(text) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text}")
    return value


def print_notes(manifest, console):
    """The compile's notes (what stayed on the host or in float, what was emulated, ...), as
    ``kiln analyze`` prints its own: they were in the manifest only, seen with --json."""
    for note in manifest.get("report", {}).get("notes", []):
        console.print(f"[yellow]note:[/] {note}", highlight=False)
