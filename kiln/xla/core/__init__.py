"""torch_xla.core on kiln: see :mod:`kiln.xla`."""
