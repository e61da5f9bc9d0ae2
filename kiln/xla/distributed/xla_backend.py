"""``torch_xla.distributed.xla_backend`` on kiln: importing it registers the ``"xla"``
backend of ``torch.distributed`` (:mod:`kiln.compat.xla_backend`)."""
import sys

from kiln.compat import xla_backend as _impl

_impl.register()
sys.modules[__name__] = _impl
