"""torch_xla.distributed on kiln: see :mod:`kiln.xla`."""
