"""baton.logs: JSON lines, the level, and the request log only when asked for."""

from __future__ import annotations

import json
import logging

import pytest
from baton.config import LogConfig
from baton.logs import configure_logging, log_request, request_log_enabled


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("baton.requests").setLevel(logging.NOTSET)


def test_json_lines_carry_the_request_logs_fields(capsys):
    configure_logging(LogConfig(level="WARNING", format="json", requests=True))
    logging.getLogger("baton.gateway").info("not at WARNING")
    logging.getLogger("baton.gateway").warning("a %s", "warning")
    log_request({"id": "req-1", "route": "chain", "ttft_s": 0.25, "total_s": 1.5,
                 "completion_tokens": 8})
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["level"] == "WARNING" and first["message"] == "a warning"
    assert first["logger"] == "baton.gateway" and first["time"].endswith("+00:00")
    assert second["logger"] == "baton.requests" and second["id"] == "req-1"
    assert second["route"] == "chain" and second["ttft_s"] == 0.25 and second["total_s"] == 1.5
    assert second["message"] == ("request id=req-1 route=chain ttft_s=0.2500 total_s=1.5000 "
                                 "completion_tokens=8")


def test_the_request_log_is_off_unless_asked_for(capsys):
    configure_logging(LogConfig(level="DEBUG"))
    assert not request_log_enabled()
    log_request({"id": "req-1"})
    assert "req-1" not in capsys.readouterr().err
    configure_logging(LogConfig(format="text", requests=True))
    assert request_log_enabled()
    log_request({"id": "req-2", "route": "local"})
    assert " baton.requests INFO request id=req-2 route=local" in capsys.readouterr().err
