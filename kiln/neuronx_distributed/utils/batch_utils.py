"""``neuronx_distributed.utils.batch_utils``."""
from __future__ import annotations


def get_batch_on_this_context_parallel_rank(batch):
    """This context-parallel rank's part of ``batch``: the whole batch, since kiln's NxD has no
    context parallelism (``context_parallel_size`` must be 1, which ``initialize_model_parallel``
    checks)."""
    from kiln.distributed import state
    if state.get_context_model_parallel_size() != 1:
        raise NotImplementedError("context parallelism (context_parallel_size > 1) is not implemented by kiln")
    return batch
