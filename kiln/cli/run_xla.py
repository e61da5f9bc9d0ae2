"""``kiln run-xla script.py [args...]``: a torch-neuronx / torch_xla training script, run
unchanged on kiln's lazy device (``import torch_xla`` resolves to ``kiln.xla``)."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub):
    p = sub.add_parser("run-xla", help="run a torch_xla / torch-neuronx training script on kiln's lazy device",
                       description=__doc__)
    p.add_argument("script", help="the Python script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.add_argument("--metrics", action="store_true", help="print the metrics report to stderr afterwards")
    p.set_defaults(fn=_run)


def main(argv) -> int:
    """Everything after the script belongs to the script (its flags included)."""
    metrics = False
    while argv and argv[0].startswith("-"):
        if argv[0] == "--metrics":
            metrics = True
            argv = argv[1:]
        elif argv[0] in ("-h", "--help"):
            print(__doc__.strip() + "\n\nusage: kiln run-xla [--metrics] script.py [args...]")
            return 0
        else:
            print(f"kiln run-xla: unknown option {argv[0]}", file=sys.stderr)
            return 2
    if not argv:
        print("usage: kiln run-xla [--metrics] script.py [args...]", file=sys.stderr)
        return 2
    if not os.path.isfile(argv[0]):
        print(f"kiln run-xla: {argv[0]}: no such script", file=sys.stderr)
        return 2
    from kiln.compat import xla_launch
    code = xla_launch.run(argv[0], argv[1:])
    if metrics:
        from kiln.device import metrics as device_metrics
        print(device_metrics.report(), file=sys.stderr, end="")
    return code


def _run(args, console) -> int:
    return main((["--metrics"] if args.metrics else []) + [args.script] + list(args.args))
