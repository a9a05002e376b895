"""Structured logs: one JSON object per line on stderr, for the server's own lines and uvicorn's.

A line names the population, round and assignment it is about (`population`, `round_id`,
`assignment_id`) so that an operator can follow one round across processes. Lines never carry
tokens, request bodies, parameters or examples: the state machine logs ids, counters and reason
classes, never a refusal's message (it may quote a report's contents); the request log names the
route template and path ids, never headers; and database errors leave their statement's
parameters out (`make_engine` hides them).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy.orm import Session

from orchestrator.observability.on_commit import on_commit

_requests = logging.getLogger("orchestrator.requests")
# What a LogRecord carries anyway; everything else on it came in through `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: time (UTC), level, logger, pid, message and the record's extras."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if (
                key not in _STANDARD and key != "color_message" and not key.startswith("_")
            ):  # uvicorn's ANSI copy
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def log_config(level: str, uvicorn_level: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` (uvicorn's `log_config`, applied in every worker process):
    JSON lines on stderr for the orchestrator's loggers at `level`, uvicorn's at `uvicorn_level` and
    every other library's warnings."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    levels = {"orchestrator": level, "uvicorn": uvicorn_level, "uvicorn.error": uvicorn_level}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler},
        "loggers": {
            name: {"handlers": ["stderr"], "level": value.upper(), "propagate": False}
            for name, value in levels.items()
        },
        # Libraries' warnings (psycopg, SQLAlchemy) as JSON lines too, not raw text from
        # logging's last-resort handler in the middle of the log.
        "root": {"handlers": ["stderr"], "level": "WARNING"},
    }


def log_on_commit(session: Session, logger: logging.Logger, message: str, **fields: Any) -> None:
    """Log `message` at INFO with `fields` once the session's transaction has committed."""
    if logger.isEnabledFor(logging.INFO):
        on_commit(session, lambda: logger.info(message, extra=fields))


def log_request(scope: dict[str, Any], route: str, status: int, seconds: float) -> None:
    """One DEBUG line per request: method, route template, the ids in its path, status and time."""
    if not _requests.isEnabledFor(logging.DEBUG):
        return
    fields: dict[str, Any] = {
        "method": scope["method"],
        "route": route,
        "status": status,
        "seconds": round(seconds, 6),
    }
    path_params = scope.get("path_params") or {}
    for key in ("population", "assignment_id"):
        if key in path_params:
            fields[key] = path_params[key]
    _requests.debug("request", extra=fields)
