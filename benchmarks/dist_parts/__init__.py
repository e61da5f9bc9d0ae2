"""Parts of ``benchmarks/distributed.py`` (issue 31's benchmark), each runnable on its own:
``allreduce`` is part (c), the cost of one all-reduce of a decode step's size."""
