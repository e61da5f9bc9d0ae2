"""Silence third-party chatter (exporters and optimisers print and warn freely) during kiln's work."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings

EXPORTER_LOGGERS = ("onnxscript", "torch.onnx", "onnx_ir")


@contextlib.contextmanager
def quiet(loggers=EXPORTER_LOGGERS):
    """Raise ``loggers`` to ERROR, drop warnings and swallow stdout for the block."""
    found = [logging.getLogger(n) for n in loggers]
    levels = [lg.level for lg in found]
    for lg in found:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(found, levels):
            lg.setLevel(level)


def import_quietly(name: str):
    """Import module ``name``, undoing a ``logging.basicConfig`` it runs on import.

    ONNX Runtime's ``matmul_nbits_quantizer`` configures the root logger at INFO with a
    stderr handler when imported: in a user's process that would print every library's
    INFO messages from then on (kiln's int8 compile of SmolLM2 printed ~6,000 lines of
    the quantizer's own). The module is imported with the root logger's handlers and
    level put back as they were."""
    import importlib
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(name)
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
