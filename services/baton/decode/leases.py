"""The pushed requests a decode pod holds for an Attach, and the ids it remembers.

A pushed request's cache arrives before (or without) the caller's Attach. Until someone
attaches, a running request waits at most ``lease_s`` (its caller is gone otherwise: it is
aborted, which frees its KV), and one that finished first keeps its steps for the Attach as
long. Aborts and push failures that came before their stream are remembered (a bounded
number: ``MEMORY``), so that a late push is refused and a late Attach told why. Nothing here
locks: the worker's lock guards it with its request table.
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

from baton.decode.streams import RequestStream

MEMORY = 1024  # ids remembered of each kind; the oldest go first
V = TypeVar("V")


class Recent(Generic[V]):
    """The last ``MEMORY`` ids seen, each with a value, oldest first out."""

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, V] = collections.OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def add(self, request_id: str, value: V) -> None:
        self._items[request_id] = value
        while len(self._items) > MEMORY:
            self._items.popitem(last=False)

    def pop(self, request_id: str) -> V | None:
        return self._items.pop(request_id, None)


class AttachLeases:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        # Pushed requests still running that nobody attached to yet, oldest first.
        self.awaiting: collections.OrderedDict[str, RequestStream] = collections.OrderedDict()
        # Pushed requests that finished before anyone attached (max_tokens 1, or a stop token
        # first), with when they finished.
        self._unclaimed: collections.OrderedDict[str, tuple[RequestStream, float]] = \
            collections.OrderedDict()

    def expired(self, now_s: float) -> list[RequestStream]:
        """The running requests nobody attached to within ``lease_s``, no longer awaited."""
        expired = []
        while self.awaiting:
            stream = next(iter(self.awaiting.values()))
            if now_s - stream.arrival_s <= self.lease_s:
                break
            self.awaiting.popitem(last=False)
            stream.expired = True
            expired.append(stream)
        return expired

    def keep_unclaimed(self, stream: RequestStream, now_s: float) -> int:
        """Hold a finished pushed stream for its Attach; the oldest go first past the lease or
        the cap, so nothing a caller never claims stays. Returns how many went."""
        self.awaiting.pop(stream.request_id, None)
        if not stream.expired:
            self._unclaimed[stream.request_id] = (stream, now_s)
        dropped = 0
        while self._unclaimed and (len(self._unclaimed) > MEMORY or
                                   now_s - next(iter(self._unclaimed.values()))[1] > self.lease_s):
            self._unclaimed.popitem(last=False)
            dropped += 1
        return dropped

    def claim_unclaimed(self, request_id: str) -> RequestStream | None:
        """A finished pushed stream held for its Attach, now attached (None if none is held)."""
        unclaimed = self._unclaimed.pop(request_id, None)
        if unclaimed is None:
            return None
        unclaimed[0].attached = True
        return unclaimed[0]
