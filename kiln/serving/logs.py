"""The server's logs: JSON lines on stderr, one event per line, under the ``kiln.serve`` logger.

Nothing is configured at import: :func:`kiln.serving.server.serve` applies
:func:`logging_config` when it starts, and an app run under another ASGI server
logs wherever that process's logging sends ``kiln.serve``.
"""
from __future__ import annotations

import datetime
import json
import logging

LOGGER_NAME = "kiln.serve"     # users configure this name; it stays the same
logger = logging.getLogger(LOGGER_NAME)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event and the record's fields."""

    def format(self, record):
        out = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "event": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log(level: str, event: str, **fields):
    """Log ``event`` with ``fields`` (each a key of the JSON line)."""
    logger.log(getattr(logging, level.upper()), event, extra={"fields": fields})


def logging_config(level: str = "info", access_log: bool = False) -> dict:
    """``logging.config.dictConfig`` settings: kiln's and uvicorn's logs as JSON lines on stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler},
        "loggers": {
            LOGGER_NAME: {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": "INFO" if access_log else "WARNING",
                               "propagate": False},
        },
    }
