"""``kiln bench``: the command-line face of :func:`kiln.bench` (its table, notes and files)."""
from __future__ import annotations

import argparse
import math
import os

from rich.console import Console

from kiln.cli.common import TRUST_HELP, non_negative_seconds, positive_seconds


def add_parser(sub):
    sp = sub.add_parser("bench", help="throughput and latency of an artifact or model factory, "
                        "optionally against eager/torchscript/torch.compile/onnxruntime/openvino")
    sp.add_argument("target", help="a .kiln artifact or package.module:factory returning (model, example_inputs)")
    sp.add_argument("--path", help="directory to import the factory's module from (default: cwd)")
    sp.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,4,8 (default 1)")
    sp.add_argument("--copies", default=None, help="model copies, one process per kiln core, e.g. 1,2 "
                    "(default: one per kiln core)")
    sp.add_argument("--workers", default="1", help="threads calling each copy, e.g. 1,2 (default 1)")
    sp.add_argument("--duration", type=positive_seconds, default=5.0, help="measured seconds per configuration")
    sp.add_argument("--warmup", type=non_negative_seconds, default=1.0, help="warm-up seconds before each runner")
    sp.add_argument("--compare", default=None, help="peers: eager,torchscript,torch.compile,onnxruntime,openvino")
    sp.add_argument("--price-per-hour", type=_price, default=None, help="instance price, for cost per 1M inferences")
    sp.add_argument("--compiler-args", default=None, help="kiln compile flags for a factory, e.g. \"-O3\"")
    sp.add_argument("--json", default=None, help="write the report here")
    sp.add_argument("--plot", default=None, help="write a throughput-vs-latency PNG here")
    sp.add_argument("--quiet", action="store_true", help="no progress lines")
    sp.add_argument("--trust-native-code", action="store_true", help=TRUST_HELP)
    sp.set_defaults(fn=cmd_bench)


def _price(text) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite price, not below 0, got {text}")
    return value


def _ints(text, what):
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        from kiln.errors import CompilerArgsError       # exit status 2, as other bad arguments (1 until 12-03)
        raise CompilerArgsError(f"{what} must be comma-separated integers, got {text!r}") from None


def cmd_bench(a, console):
    from kiln import benchmark
    if a.trust_native_code:   # the copies are processes of their own: they read it from the environment
        os.environ["KILN_TRUST_NATIVE_CODE"] = "1"
    options = {"compiler_args": a.compiler_args} if a.compiler_args else {}
    report = benchmark.bench(
        a.target, path=a.path, batch_sizes=_ints(a.batch_sizes, "--batch-sizes"),
        copies=_ints(a.copies, "--copies") if a.copies else None, workers=_ints(a.workers, "--workers"),
        duration=a.duration, warmup=a.warmup, compare=[c for c in (a.compare or "").split(",") if c],
        price_per_hour=a.price_per_hour, json_path=a.json, plot_path=a.plot, quiet=a.quiet,
        compile_options=options)
    if not console.is_terminal:   # a file or pipe: no need to squeeze the table into 80 columns
        console = Console(width=120)
    console.print(benchmark.table(report))
    for line in benchmark.notes(report):
        console.print(line, highlight=False, markup=False)
    if a.json:
        console.print(f"JSON: {a.json}")
    if a.plot:
        console.print(f"plot: {a.plot}")
    return 0 if report["results"] else 1
