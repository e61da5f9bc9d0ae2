"""``torch_xla.distributed.xla_backend`` on kiln: importing it registers the ``"xla"``
backend of ``torch.distributed`` (:mod:`kiln.device.process_group`)."""
import sys

from kiln.device import modes
from kiln.device import process_group as _impl

modes.device()          # registered under its name (KILN_DEVICE_NAME) before the backend names it
_impl.register()
sys.modules[__name__] = _impl
