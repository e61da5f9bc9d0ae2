"""kiln as a place PyTorch runs programs, not only traces: the graphs PyTorch hands over
at run time go through kiln's compiler (partitioning with host fallback, engines chosen
by measurement, the compile cache, the check against eager).

* :mod:`kiln.device.graphs`: one FX graph of flat tensors, compiled or, when it cannot
  be, run eagerly with a warning that says why; every compile counted.
* :mod:`kiln.device.metrics`: those counts and timings (torch_xla's metrics report), and
  the warning when one graph keeps recompiling for new shapes.
* :mod:`kiln.device.compile_backend`: ``torch.compile(model, backend="kiln")``, forward
  and backward graphs through AOTAutograd.
"""
