"""``torch_xla.runtime`` on kiln: this module *is* :mod:`kiln.compat.xla_runtime`."""
import sys

from kiln.compat import xla_runtime as _impl

sys.modules[__name__] = _impl
