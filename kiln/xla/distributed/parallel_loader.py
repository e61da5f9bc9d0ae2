"""``torch_xla.distributed.parallel_loader`` on kiln: this module *is*
:mod:`kiln.compat.xla_loader`."""
import sys

from kiln.compat import xla_loader as _impl

sys.modules[__name__] = _impl
