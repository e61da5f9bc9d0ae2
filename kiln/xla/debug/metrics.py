"""``torch_xla.debug.metrics`` on kiln: this module *is* :mod:`kiln.compat.xla_metrics`."""
import sys

from kiln.compat import xla_metrics as _impl

sys.modules[__name__] = _impl
