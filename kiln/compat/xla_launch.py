"""``kiln run-xla script.py [args]``: run a torch-neuronx / torch_xla training script
unchanged on kiln's lazy device.

The script's ``import torch_xla...`` resolve to :mod:`kiln.xla`'s modules (and
``import torch_neuronx`` to :mod:`kiln.neuronx`) through an import hook installed before
the script runs as ``__main__``; nothing is written to disk. ``kiln run-xla --metrics``
prints the metrics report to stderr after the script.

A script started without a launcher runs as the one worker of ``torchrun
--nproc_per_node=1``, the way Neuron's guides start even a single worker: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and the rest are set where none of them is. Without them
accelerate (on any torch_xla device but a TPU) and so Hugging Face's ``Trainer`` read
``LOCAL_RANK`` as -1: ``is_local_process_zero()`` was False in the only process, and the
Trainer's logging (``should_log``) and accelerate's ``is_local_main_process`` work were
silently skipped.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import runpy
import sys

ALIASES = {"torch_xla": "kiln.xla", "torch_neuronx": "kiln.neuronx"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_xla.x.y`` as ``kiln.xla.x.y`` (the same module object)."""

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".", 1)[0]
        if root not in ALIASES:
            return None
        target_name = ALIASES[root] + fullname[len(root):]
        if importlib.util.find_spec(target_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        root = spec.name.split(".", 1)[0]
        return importlib.import_module(ALIASES[root] + spec.name[len(root):])

    def exec_module(self, module):
        pass


def install():
    """Make ``torch_xla`` and ``torch_neuronx`` imports resolve to kiln's (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())


_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def one_worker_environment():
    """``torchrun --nproc_per_node=1``'s variables, where no launcher set any (module doc)."""
    import os
    if not any(name in os.environ for name in _LAUNCHER_VARIABLES):
        from kiln.compat import xla_spawn
        for name, value in xla_spawn.torchrun_environment(0, 1, xla_spawn.free_port()).items():
            os.environ.setdefault(name, value)          # a MASTER_ADDR of the user's stays


def run(script: str, args: list) -> int:
    install()
    one_worker_environment()
    sys.argv = [script] + list(args)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
