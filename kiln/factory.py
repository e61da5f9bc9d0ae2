"""Load a model named ``package.module:factory``: the one spelling ``kiln`` commands and ``kiln.bench`` share.

The factory returns ``(model, example_inputs)``, where example_inputs is a
tensor, a tuple of positional inputs or a dict of keyword inputs. It lives
here, at the base layer (it needs only :mod:`kiln.errors` and the standard
library), so the command line and the benchmark both use it without either
importing the other.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

from kiln.errors import KilnError


def load_factory(spec: str, path: str | None):
    """Import ``spec`` with ``path`` (default: the current directory) on ``sys.path``, call it, check its result."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise KilnError(f"model must be named package.module:factory, got {spec!r}")
    sys.path.insert(0, os.path.abspath(path or os.getcwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise KilnError(f"cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise KilnError(f"{module_name} has no attribute {attr!r}")
    if not callable(factory):
        raise KilnError(f"{spec} is a {type(factory).__name__}, not a function returning (model, example_inputs)")
    check_no_arguments(factory, spec)
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise KilnError(f"{spec} must return (model, example_inputs)")
    return made


def check_no_arguments(factory, spec: str) -> None:
    """A :class:`KilnError` when ``factory`` cannot be called with no arguments, as a factory is."""
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise KilnError(f"{spec}{inspect.signature(factory)} needs arguments; a factory is called with none "
                        "and returns (model, example_inputs)") from None
    except ValueError:          # no signature to read (a builtin): let the call say
        pass
