"""``kiln serve``: hands its arguments to :mod:`kiln.serving`, which has its own parser.

``kiln serve`` is dispatched before the main parser runs (see
:func:`kiln.cli.app.main`), so starlette and uvicorn load only when serving;
the subparser here exists so ``kiln --help`` lists the command.
"""
from __future__ import annotations


def add_parser(sub):
    sub.add_parser("serve", help="serve .kiln artifacts over HTTP (Open Inference Protocol / KServe v2); "
                   "see kiln serve --help")


def main(argv) -> int:
    """Run ``kiln serve ARGV...`` (the arguments after ``serve``)."""
    from kiln.serving.server import main as serve_main
    return serve_main(argv)
