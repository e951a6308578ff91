"""Files a running server re-reads when they change (certificates, API keys): how it tells."""

from __future__ import annotations

import os


def change_fingerprint(*paths: str) -> tuple:
    """Changes whenever any of ``paths`` changes (modification time and size); raises
    OSError for a file that cannot be read."""
    return tuple((stat.st_mtime_ns, stat.st_size) for stat in map(os.stat, paths))
