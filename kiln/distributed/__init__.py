"""kiln's distributed layer: ranks in processes of their own, on one host's kiln cores or
across hosts, talking through ``torch.distributed`` (gloo on CPUs, NCCL on GPUs; a
shared-memory path for same-host ranks where it measures faster).

It sits beside :mod:`kiln.runtime` (one layer below it: the runtime's tensor-parallel
LLMs use its collectives) and imports nothing of the compiler. Modules:

* :mod:`groups`: symbolic group names (``"tp"``, ``"dp"``, ``"pp"``, ``"world"``) bound
  to real process groups, or to in-process thread groups for compile-time checks;
* :mod:`ops`: the collectives as functional ``torch.library`` operators
  (``kiln::all_reduce``, ``kiln::all_gather``, ``kiln::reduce_scatter``) that
  ``torch.export`` keeps as graph nodes, which become host steps in a compiled graph's
  program and resolve their group by name when they run.
"""
