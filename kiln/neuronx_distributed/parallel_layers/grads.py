"""``neuronx_distributed.parallel_layers.grads``."""
from kiln.distributed.grads import (  # noqa: F401
    clip_grad_norm, clip_grads_with_norm, get_grad_norm, param_is_not_shared,
)
from kiln.distributed.nxd_wrappers import bucket_allreduce_gradients  # noqa: F401,E402
