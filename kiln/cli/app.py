"""The ``kiln`` parser, assembled from the command modules, and ``main``.

Each command module (compile, inspect, trust, observe, bench, serve, cache, llm, export, port, doctor)
contributes ``add_<command>(subparsers)`` functions that add one subcommand
and set its handler, ``fn(args, console) -> exit code``. ``COMMANDS`` below
lists them in the order ``kiln --help`` shows them.
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console

from kiln.cli import bench, cache, doctor, export, llm, observe, port, run_xla, serve, trust
from kiln.cli import compile as compile_cmds
from kiln.cli import inspect as inspect_cmd

COMMANDS = (compile_cmds.add_analyze, compile_cmds.add_compile, compile_cmds.add_run, inspect_cmd.add_parser,
            trust.add_parser, observe.add_ls, bench.add_parser, serve.add_parser, observe.add_monitor,
            observe.add_top, cache.add_cache, cache.add_parallel_compile, llm.add_parser, export.add_parser,
            port.add_parser, doctor.add_parser, run_xla.add_parser)


def build_parser():
    p = argparse.ArgumentParser(prog="kiln", description="Compile PyTorch models ahead of time and run them.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:   # its own parser; starlette/uvicorn load only when serving
        return serve.main(argv[1:])
    if argv[:1] == ["run-xla"]:  # the script's arguments are the script's, flags included
        return run_xla.main(argv[1:])
    if argv[:2] == ["export", "neuron"]:   # optimum-cli export neuron ..., with kiln for optimum-cli
        argv = ["export", *argv[2:]]
    args, extra = build_parser().parse_known_args(argv)
    takes_flags = args.cmd in compile_cmds.TAKES_BARE_COMPILER_FLAGS
    if extra:
        # Compiler flags may be given bare after the model: kiln compile m:f -O3 --target generic
        if takes_flags:
            args.compiler_args = (args.compiler_args.split() if args.compiler_args else []) + extra
        else:
            build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    elif takes_flags and args.compiler_args:
        args.compiler_args = args.compiler_args.split()
    console = Console(stderr=False)
    from kiln.errors import KilnError
    try:
        return args.fn(args, console)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
