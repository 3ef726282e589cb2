"""The service's log: one configuration for qgemm's own lines and uvicorn's, as text or as JSON lines.

`qgemm serve` hands `config()` to uvicorn, which applies it in every process it starts (workers included), so
that `--log-format json` makes every line a JSON object: time, level, logger, message (and the exception's
traceback where there is one), ready for a log shipper.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson


class JsonLines(logging.Formatter):
    """One JSON object a record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


TEXT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def config(level: str = "info", fmt: str = "text") -> dict[str, Any]:
    """A logging.config dict for qgemm's logger and uvicorn's (`uvicorn.run(log_config=...)`)."""
    formatter = {"()": f"{__name__}.JsonLines"} if fmt == "json" else {"format": TEXT, "datefmt": "%Y-%m-%d %H:%M:%S"}
    handler = {"class": "logging.StreamHandler", "formatter": "qgemm", "stream": "ext://sys.stderr"}
    level = level.upper()
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"qgemm": formatter}, "handlers": {"qgemm": handler},
        "loggers": {name: {"handlers": ["qgemm"], "level": level, "propagate": False}
                    for name in ("qgemm", "uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def setup(level: str = "info", fmt: str = "text") -> None:
    """Configure logging in this process (commands other than serve, whose uvicorn applies `config`)."""
    import logging.config

    logging.config.dictConfig(config(level, fmt))
