"""``torch_xla.utils.serialization`` (``xser``) on kiln: ``save``, ``load`` and
``TensorReference`` in torch_xla's checkpoint layout (:mod:`kiln.compat.xla_serialization`)."""
import sys

from kiln.compat import xla_serialization as _impl

sys.modules[__name__] = _impl
