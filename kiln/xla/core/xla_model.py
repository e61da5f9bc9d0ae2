"""``torch_xla.core.xla_model`` on kiln: this module *is* :mod:`kiln.compat.xla_model`."""
import sys

from kiln.compat import xla_model as _impl

sys.modules[__name__] = _impl
