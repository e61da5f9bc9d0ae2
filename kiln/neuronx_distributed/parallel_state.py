"""``neuronx_distributed.parallel_state``, the path NxD's docs use although NxD never had
it: the same module object as ``parallel_layers.parallel_state`` (kiln.distributed.state)."""
import sys

from kiln.distributed import state as _impl

sys.modules[__name__] = _impl
