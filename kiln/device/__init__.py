"""kiln as a place PyTorch runs programs, not only traces: the graphs PyTorch hands over
at run time go through kiln's compiler (partitioning with host fallback, engines chosen
by measurement, the compile cache, the check against eager).

The ``kiln`` device (PrivateUse1, written in Python):

* :mod:`kiln.device.registration`: the backend, ``torch.kiln``, the factory fallback.
* :mod:`kiln.device.autoload`: what ``import torch`` calls (the ``torch.backends`` entry
  point, through ``kiln_autoload``): the device registered under ``KILN_DEVICE_NAME``.
* :mod:`kiln.device.tensor`: the device tensor (host data, or a pending value).
* :mod:`kiln.device.dispatch` and :mod:`kiln.device.rewrites`: each operation recorded
  into the current program or run now on host data.
* :mod:`kiln.device.foreach`: ``_foreach_*`` calls (optimizer steps) recorded whole.
* :mod:`kiln.device.trace`: the recorded program, its key, and what a flush does.
* :mod:`kiln.device.modes`: eager mode (queued windows) and lazy mode (``mark_step``).
* :mod:`kiln.device.autocast`: CPU's auto-cast rules on the device.

Shared with ``torch.compile``:

* :mod:`kiln.device.graphs`: one FX graph of flat tensors, compiled or, when it cannot
  be, run eagerly with a warning that says why; every compile counted.
* :mod:`kiln.device.metrics`: those counts and timings (torch_xla's metrics report), and
  the warning when one graph keeps recompiling for new shapes.
* :mod:`kiln.device.compile_backend`: ``torch.compile(model, backend="kiln")``, forward
  and backward graphs through AOTAutograd.
"""
