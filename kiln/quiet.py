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
