"""Free TCP ports on the loopback interface, for processes started on this machine."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after; another process may
    take it in between, which a local start then reports as its bind error)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
