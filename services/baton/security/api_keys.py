"""The API keys a gateway's clients present, read from a file (a mounted Secret).

One key per line, as ``KEY`` or ``NAME KEY`` (blank lines and ``#`` comments are skipped);
a key without a name is known by its line (``key-3``). The file is re-read when its
modification time or size changes, so a rotated Secret takes effect without a restart; a
file that cannot be read keeps the last keys (logged), and a gateway whose configured file
never could be read refuses every request rather than letting them in.

Keys are compared with ``hmac.compare_digest`` against every known key, so the time taken
says nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac
import logging
import threading
from pathlib import Path

from baton import files
from baton.errors import Unauthenticated

log = logging.getLogger(__name__)


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._keys: dict[bytes, str] = {}  # key -> name
        self._seen: tuple | None = None
        if self.path is None:
            log.warning("NO API KEYS: every client may call this gateway (set --auth-api-keys-file)")
        else:
            self._reload()
            log.info("API keys from %s: %d", self.path, len(self._keys))

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def identify(self, authorization: str | None) -> str:
        """The caller's identity from an ``Authorization: Bearer KEY`` value ("" when keys are
        off); raises Unauthenticated when a key is needed and missing or wrong."""
        if self.path is None:
            return ""
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("an API key is required: send `Authorization: Bearer KEY`")
        self._reload()
        given = key.strip().encode()
        with self._lock:
            known = list(self._keys.items())
        name = ""
        for candidate, candidate_name in known:  # every key is compared: no early exit
            if hmac.compare_digest(candidate, given):
                name = candidate_name
        if not name:
            raise Unauthenticated("the API key is not valid")
        return name

    def _reload(self) -> None:
        try:
            current = files.change_fingerprint(str(self.path))
            if self._seen == current:
                return
            keys = _parse(self.path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.error("cannot read API keys from %s (keeping the %d known): %s", self.path,
                      len(self._keys), e)
            return
        with self._lock:
            self._keys, self._seen = keys, current


def _parse(text: str) -> dict[bytes, str]:
    keys: dict[bytes, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"line {number} has {len(fields)} fields; expected `KEY` or `NAME KEY`")
        name, key = (fields[0], fields[1]) if len(fields) == 2 else (f"key-{number}", fields[0])
        keys[key.encode()] = name
    return keys
