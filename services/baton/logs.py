"""Every server's logging: its level, text or JSON lines, and the opt-in request log
(``baton.config.LogConfig``; docs/operations.md, "Traces and logs").

JSON lines carry ``time``, ``level``, ``logger`` and ``message``, plus the fields a record
was given under ``extra={"fields": {...}}``: a request log line's id, route and timings are
keys a log collector can index, not text to parse.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from baton.config import LogConfig

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
REQUESTS_LOGGER = "baton.requests"  # the one-line-per-request log (LogConfig.requests)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(config: LogConfig) -> None:
    """Route the root logger to stderr at ``config.level`` in ``config.format``; the request
    log is on only when ``config.requests`` says so."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    # Its own level: the request log is written at INFO whatever the others' level is.
    logging.getLogger(REQUESTS_LOGGER).setLevel(logging.INFO if config.requests else logging.CRITICAL + 1)


def log_request(fields: dict[str, Any]) -> None:
    """The request log's line for one finished request (``fields``: what it is made of)."""
    logger = logging.getLogger(REQUESTS_LOGGER)
    text = " ".join(f"{key}={_text(value)}" for key, value in fields.items())
    logger.info("request %s", text, extra={"fields": fields})


def request_log_enabled() -> bool:
    return logging.getLogger(REQUESTS_LOGGER).isEnabledFor(logging.INFO)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
