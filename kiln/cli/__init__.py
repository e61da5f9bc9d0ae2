"""The ``kiln`` command line: analyze, compile, run, inspect, key, ls, bench, serve, monitor, top, cache, parallel-compile, llm, run-xla.

A model is named ``package.module:factory``; the factory returns
``(model, example_inputs)`` where example_inputs is a tensor, a tuple of
positional inputs or a dict of keyword inputs. ``--path DIR`` (default: the
current directory) is put on ``sys.path`` so local modules can be named
(:func:`kiln.factory.load_factory`).

Layout: ``app`` builds the parser from the command modules and holds
``main``; each command group is one module (``compile``: analyze, compile,
run; ``inspect``; ``trust``: key; ``observe``: ls, monitor, top; ``bench``;
``serve``; ``cache``: cache, parallel-compile; ``llm``; ``run_xla``) with an ``add_<command>``
function per subcommand and its handler. Handlers import kiln, torch and the
engines lazily, so building the parser stays cheap.
"""
from kiln.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
