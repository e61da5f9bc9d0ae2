"""``neuronx_distributed.utils.logger``: NxD's logger, on Python's ``logging``."""
from __future__ import annotations

import logging


class _RankZero(logging.Filter):
    def filter(self, record) -> bool:
        from kiln.distributed import state
        return state.is_global_rank_zero()


def get_logger(name: str = "neuronx_distributed", rank0_only: bool = True) -> logging.Logger:
    """The logger ``name`` (INFO and above to stderr, once per process); ``rank0_only``: its
    records are dropped on every rank but global rank 0, as NxD's are."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_kiln_nxd", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._kiln_nxd = True
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if rank0_only and not any(isinstance(f, _RankZero) for f in logger.filters):
        logger.addFilter(_RankZero())
    return logger
