"""``torch_xla.distributed.xla_multiprocessing`` on kiln: ``spawn`` and friends
(:mod:`kiln.compat.xla_spawn`)."""
import sys

from kiln.compat import xla_spawn as _impl

sys.modules[__name__] = _impl
