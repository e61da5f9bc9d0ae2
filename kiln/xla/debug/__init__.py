"""torch_xla.debug on kiln: see :mod:`kiln.xla`."""
