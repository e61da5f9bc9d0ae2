"""``kiln port MODEL``: which tier a model is in, its blockers at their lines with fixes, the
cost, and (``--out DIR``) a Markdown/HTML report with pictures (kiln.port)."""
from __future__ import annotations

import json

from kiln.cli.common import positive_int


def add_parser(sub):
    p = sub.add_parser("port", help="try a model and report its porting tier, blockers, cost and pictures")
    p.add_argument("model", help="package.module:factory, file.py[:factory] or a Hugging Face checkpoint directory")
    p.add_argument("--out", default=None, help="write report.md, report.html, report.json and the pictures here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    p.add_argument("--batch-size", "--batch_size", type=positive_int, default=None, dest="batch_size",
                   help="a Hugging Face directory's batch (default 1)")
    p.add_argument("--sequence-length", "--sequence_length", type=positive_int, default=None, dest="sequence_length",
                   help="a Hugging Face text model's tokens (default 128)")
    p.add_argument("--timing", type=float, default=0.5, help="seconds to time eager and kiln each (default 0.5)")
    p.add_argument("--compiler-args", default=None, help="kiln compiler flags for the -O1 compile")
    p.set_defaults(fn=run)


def run(args, console) -> int:
    import contextlib
    import sys
    from kiln.port import port
    from kiln.port import report as report_mod
    # what the model prints while it is traced and timed goes to stderr: with --json, stdout is
    # the report alone, for a script to parse (a model's own prints had come before it there)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = port(args.model, batch_size=args.batch_size, sequence_length=args.sequence_length,
                      compiler_args=args.compiler_args.split() if args.compiler_args else None,
                      timing_budget=args.timing)
    files = report_mod.write(report, args.out) if args.out else {}
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        report_mod.summary(report, console)
        for name, path in files.items():
            print(f"wrote {path}")
    return 0
