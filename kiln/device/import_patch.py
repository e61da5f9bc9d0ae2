"""Patch a module of another library when it is imported, not before.

Some of kiln's device shims change one function of a library the script may never
import (FSDP2's default mesh, accelerate's accelerator discovery); importing it up front
would cost every ``import torch`` its import time (most of a second for FSDP2). A finder
on ``sys.meta_path`` wraps the module's loader once, and the patch runs right after the
module's own code, before any other module can copy the patched name with ``from ...
import``.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


def when_imported(target: str, patch) -> None:
    """Call ``patch(module)`` on ``target`` now if it is imported, else when it is."""
    module = sys.modules.get(target)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _Finder) and f.target == target for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(target, patch))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, target, patch):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)          # once: the module's own finder does the rest
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader, self.patch)
        return spec


class _Patching(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)
