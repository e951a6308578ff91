"""Where each request lives: the gateway's live requests, mirrored into the routing store.

Design: the gateway keeps its own table of the requests it is streaming (their downstream
calls, so a client cancellation or an Abort can reach them) and writes a ``RequestRecord``
per request into the routing store with a TTL, so that an Abort arriving at another gateway
replica finds the pods that hold state. The store is disposable (docs/architecture.md,
"Routing state"): when it is down the gateway goes on with its own table, logs once, and duplicate ids are then caught
only among its own requests.

``in_flight()`` sums the live requests per address for the routing policy: it covers what
this gateway sent since the workers' last heartbeat.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.errors import AlreadyExists
from baton.gateway.routing_policy import InFlight
from baton.routing import RequestRecord, RoutingStore, StoreUnavailable

log = logging.getLogger(__name__)

# The longest a rewrite or removal of a request's record waits for its first write (which
# runs on the store client's own bounded timeouts; this only keeps the order).
RECORD_WAIT_S = 10.0


class DuplicateRequest(AlreadyExists):
    """A live request already has this id (gRPC ALREADY_EXISTS)."""


@dataclass
class LiveRequest:
    """One request this gateway is streaming; ``calls`` are its open downstream RPCs."""

    record: RequestRecord
    num_prompt_tokens: int
    # of them, those the route expected its decode pod's prefix cache to hold
    cached_tokens: int = 0
    # Writes a moved request's record to the store (RequestTable.admit sets it); blocking.
    rewrite: Callable[[RequestRecord], None] = lambda record: None
    calls: list = field(default_factory=list)  # grpc.Call objects, cancelled on client cancel
    aborted: threading.Event = field(default_factory=threading.Event)
    completed: bool = False  # the last step was produced: nothing is left to abort
    chain_done: bool = False  # the chain's part is over (KV shipped, or it failed)
    prefilled: bool = False  # its first token has come: its prompt costs no more prefill
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set once the store holds the record (or cannot): a rewrite or a removal waits for it.
    recorded: threading.Event = field(default_factory=threading.Event)
    traceparent: str = ""  # W3C: the gateway's span of it, the parent of the pods' ("" = untraced)

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def watch(self, call) -> None:
        """Track a downstream call; one opened after an abort is cancelled at once."""
        with self.lock:
            self.calls.append(call)
        if self.aborted.is_set():
            call.cancel()

    def cancel_calls(self) -> None:
        with self.lock:
            calls = list(self.calls)
        for call in calls:
            call.cancel()

    def busy_at(self) -> list[tuple[str, int]]:
        """The pods this request still costs work, each with the prompt tokens it has yet to
        prefill there (what the routing policy counts as in flight): its chain the whole
        prompt until the chain's part is over; its decode pod, when no chain prefills for it,
        what its prefix cache was expected to lack, until the first token."""
        chain = self.record.prefill_address
        busy = [(chain, self.num_prompt_tokens)] if chain and not self.chain_done else []
        decode = self.record.decode_address
        if decode:
            local = not chain and not self.prefilled
            busy.append((decode, self.num_prompt_tokens - self.cached_tokens if local else 0))
        return busy


class RequestTable:
    def __init__(self, store: RoutingStore, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._live: dict[str, LiveRequest] = {}
        self._store_reachable = True

    def admit(self, record: RequestRecord, num_prompt_tokens: int,
              new_id: bool = False, cached_tokens: int = 0) -> LiveRequest:
        """Register a new request; raises DuplicateRequest when its id is live anywhere.

        An id this gateway has just made (``new_id``) is live nowhere else, and nobody can
        name it before the request's first step does: its record is left for ``record`` to
        write while the request runs, off its first token's path."""
        record = dataclasses.replace(record, created_at=time.time())
        live = LiveRequest(record, num_prompt_tokens, cached_tokens, self._rewrite)
        with self._lock:
            if record.request_id in self._live:
                raise DuplicateRequest(f"request id {record.request_id!r} is already live")
            self._live[record.request_id] = live
        if new_id:
            return live
        written = self._store_call(self.store.put_request, record, self.ttl_s, if_absent=True)
        live.recorded.set()
        if written is False:
            with self._lock:
                del self._live[record.request_id]
            raise DuplicateRequest(f"request id {record.request_id!r} is already live "
                                   f"(recorded by another gateway)")
        return live

    def record(self, live: LiveRequest) -> None:
        """Write the record of a request admitted with a ``new_id`` (blocking)."""
        try:
            self._store_call(self.store.put_request, live.record, self.ttl_s)
        finally:
            live.recorded.set()

    def _rewrite(self, record: RequestRecord) -> None:
        """A live request moved (another decode pod, or a chain again under a new pod id):
        an Abort at another gateway replica must find where it is now."""
        self._after_its_record(record.request_id)
        self._store_call(self.store.put_request, record, self.ttl_s)

    def get(self, request_id: str) -> LiveRequest | None:
        with self._lock:
            return self._live.get(request_id)

    def find_record(self, request_id: str) -> RequestRecord | None:
        """Where a request lives: this gateway's table first, then the store."""
        live = self.get(request_id)
        if live is not None:
            return live.record
        return self._store_call(self.store.get_request, request_id)

    def finish(self, request_id: str) -> None:
        self._after_its_record(request_id)
        with self._lock:
            self._live.pop(request_id, None)
        self._store_call(self.store.remove_request, request_id)

    def _after_its_record(self, request_id: str) -> None:
        """Wait (``RECORD_WAIT_S`` at most) until a live request's first record is written, so
        that no later write or removal lands before it."""
        live = self.get(request_id)
        if live is not None:
            live.recorded.wait(RECORD_WAIT_S)

    def in_flight(self) -> dict[str, InFlight]:
        """Per address, the live requests there and the prompt tokens they have yet to prefill
        there (``LiveRequest.busy_at``): a floor under what a pod last reported, for the
        requests sent since. A prompt counts until its first token, not while it decodes: a
        pod streaming long conversations is not a pod with a long queue. (A request a failed
        chain or pod sends to be prefilled elsewhere is not counted again: the pod reports it.)"""
        totals: dict[str, InFlight] = {}
        with self._lock:
            live = list(self._live.values())
        for request in live:
            for address, prompt_tokens in request.busy_at():
                known = totals.get(address, InFlight())
                totals[address] = InFlight(known.requests + 1, known.prompt_tokens + prompt_tokens)
        return totals

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def _store_call(self, method, *args, **kwargs):
        """Call the store; None when it is unreachable (logged when an outage starts)."""
        try:
            result = method(*args, **kwargs)
        except StoreUnavailable as e:
            if self._store_reachable:
                log.warning("request table continues without the routing store: %s", e)
            self._store_reachable = False
            return None
        self._store_reachable = True
        return result
