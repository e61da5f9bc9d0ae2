"""``neuronx_distributed.parallel_layers.parallel_state``: this module object *is*
:mod:`kiln.distributed.state` (one set of module-level state, whichever name a script
imports it by, including the documented ``neuronx_distributed.parallel_state``)."""
import sys

from kiln.distributed import state as _impl

sys.modules[__name__] = _impl
