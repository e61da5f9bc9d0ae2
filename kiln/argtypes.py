"""argparse types for counts and durations, shared by the ``kiln`` commands and ``kiln serve``
(which sits below the command line): a bad value fails at parse time with the usage line and
exit status 2, before any model loads."""
import argparse
import math


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


def port(text) -> int:
    """A TCP port, 0 (pick a free one) to 65535 (``--port 70000`` was socket's OverflowError
    traceback until 12-03)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 (any free port) to 65535, got {value}")
    return value
