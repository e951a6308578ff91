"""Rank 0 <-> tail: per-request details and events through the chain's rendezvous store.

Why this path: the chain broadcasts only what every rank computes with (op, numeric id,
partition, token ids). The tail alone also needs the request's string id, sampling and
compression settings and the decode pod's address, and rank 0 alone needs what the tail
learns (the first token, then "shipped" or an error). Every rank already reaches rank 0's
``TCPStore`` (the ``tcp://master_addr:master_port`` rendezvous of the process group), a
key-value store whose ``get`` blocks until a key exists: rank 0 writes
``request/<id>`` before it queues the request, the tail reads it, and the tail writes
``first/<id>`` and ``done/<id>`` that rank 0's gRPC handler waits for. No new port, no
new protocol, and the chain's collectives stay untouched.

Rank 0's handlers are coroutines: they do not block on the store. One thread
(``EventPump``) watches a counter the tail bumps after every event it writes, and when it
moves, reads the events that arrived and resolves the waiting handlers' futures; while
nobody waits it sleeps.

Values: the request is its ``PrefillRequest`` protobuf; events are JSON (``{"error": ...}``
with a gRPC status name for failures). Each thread keeps its own store client (handlers run
on many threads; a client is one TCP connection).

Sealed: the store listens on rank 0's own address, but anyone who reaches that port could
read and write keys. Every value (requests and events; abort flags and the counter carry no
payload) is AES-GCM encrypted and authenticated with the chain's key (``seal_with``), which
rank 0 made at start and broadcast over the process group: an outsider reads ciphertext and
cannot forge a request or an event (a forged value fails its tag: the request fails).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from baton.api import convert
from baton.api.requests import PrefillRequest
from baton.api.v1 import prefill_pb2

KEY_PREFIX = "baton/prefill"
EVENTS_KEY = f"{KEY_PREFIX}/events"  # bumped by the tail after every event it writes
PUMP_POLL_S = 0.002  # how often the pump reads the counter while handlers wait
NONCE_BYTES = 12  # AES-GCM's nonce, random per value


class ChainEventTimeout(Exception):
    """The tail did not report in time (the chain is stuck or gone)."""


class ChainTampered(Exception):
    """A value in the store failed its authentication tag: somebody else wrote it."""


class ChainExchange:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._local = threading.local()
        self._cipher: AESGCM | None = None

    def seal_with(self, key: bytes) -> None:
        """Encrypt and authenticate every value from now on with the chain's ``key``."""
        self._cipher = AESGCM(key)

    def seal(self, name: str, data: bytes) -> bytes:
        if self._cipher is None:
            raise RuntimeError("the chain's key is not shared yet")
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._cipher.encrypt(nonce, data, name.encode())  # bound to its key name

    def unseal(self, name: str, value: bytes) -> bytes:
        if self._cipher is None:
            raise RuntimeError("the chain's key is not shared yet")
        try:
            return self._cipher.decrypt(value[:NONCE_BYTES], value[NONCE_BYTES:], name.encode())
        except InvalidTag:
            raise ChainTampered(f"{name} in the chain's store was not written by this chain") from None

    def _store(self, timeout_s: float) -> dist.TCPStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = dist.TCPStore(self.host, self.port, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
            self._local.store = store
        store.set_timeout(timedelta(seconds=timeout_s))
        return store

    @staticmethod
    def _key(kind: str, chain_request_id: int) -> str:
        return f"{KEY_PREFIX}/{kind}/{chain_request_id}"

    # --- rank 0 ------------------------------------------------------------------------

    def publish_request(self, chain_request_id: int, request: PrefillRequest) -> None:
        message = convert.prefill_request_to_proto(request)
        key = self._key("request", chain_request_id)
        self._store(10.0).set(key, self.seal(key, message.SerializeToString()))


    def abort(self, chain_request_id: int) -> None:
        self._store(10.0).set(self._key("abort", chain_request_id), b"1")

    def forget(self, chain_request_id: int) -> None:
        store = self._store(10.0)
        for kind in ("request", "first", "done", "abort"):
            store.delete_key(self._key(kind, chain_request_id))

    # --- the tail (and rank 0 when it reports a broken chain) ---------------------------

    def read_request(self, chain_request_id: int, timeout_s: float) -> PrefillRequest:
        key = self._key("request", chain_request_id)
        message = prefill_pb2.PrefillRequest()
        message.ParseFromString(self.unseal(key, self._store(timeout_s).get(key)))
        return convert.prefill_request_from_proto(message)

    def is_aborted(self, chain_request_id: int) -> bool:
        return self._store(10.0).check([self._key("abort", chain_request_id)])

    def report(self, chain_request_id: int, kind: str, event: dict) -> None:
        store = self._store(10.0)
        key = self._key(kind, chain_request_id)
        store.set(key, self.seal(key, json.dumps(event).encode()))
        store.add(EVENTS_KEY, 1)  # after the event: a pump that sees the count finds it

    def report_error(self, chain_request_id: int, code: str, message: str) -> None:
        """Fail the request on rank 0, whichever event it is waiting for."""
        event = {"error": {"code": code, "message": message}}
        for kind in ("first", "done"):
            key = self._key(kind, chain_request_id)
            if not self._store(10.0).check([key]):
                self.report(chain_request_id, kind, event)


class EventPump:
    """Rank 0: the tail's events for the handlers that wait for them, from one thread.

    ``wait`` (on an event loop) returns a future resolved with the event's JSON. The thread
    sleeps while nobody waits; otherwise it reads the tail's event counter every
    ``PUMP_POLL_S`` and, when it moved (or a new waiter came), reads the events that exist."""

    def __init__(self, exchange: ChainExchange) -> None:
        self.exchange = exchange
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._recheck = threading.Event()  # a new waiter: its event may be there already
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefill-events", daemon=True)
        self._thread.start()

    async def wait(self, chain_request_id: int, kind: str, timeout_s: float) -> dict:
        """The tail's ``kind`` event ("first" or "done") for the request; ChainEventTimeout
        after ``timeout_s``. A caller that is cancelled stops waiting (nothing is left)."""
        key = self.exchange._key(kind, chain_request_id)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting[key] = (loop, future)
        self._recheck.set()
        try:
            return json.loads(await asyncio.wait_for(future, timeout_s))
        except TimeoutError:
            raise ChainEventTimeout(f"the chain's tail did not report {kind!r} for request "
                                    f"{chain_request_id} within {timeout_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(key, None)

    def stop(self) -> None:
        self._stopping.set()
        self._recheck.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        store = None  # this thread's own client, made once somebody waits (the chain is up)
        seen = -1
        while not self._stopping.is_set():
            with self._lock:
                keys = list(self._waiting)
            if not keys:
                self._recheck.wait(0.5)
                continue
            store = store or self.exchange._store(10.0)
            recheck = self._recheck.is_set()
            self._recheck.clear()
            count = store.add(EVENTS_KEY, 0)
            if count == seen and not recheck:
                time.sleep(PUMP_POLL_S)
                continue
            seen = count
            for key in keys:
                if store.check([key]):
                    try:
                        value = self.exchange.unseal(key, store.get(key))
                    except ChainTampered as e:  # the request fails; the chain goes on
                        value = json.dumps({"error": {"code": "DATA_LOSS", "message": str(e)}}).encode()
                    self._resolve(key, value)

    def _resolve(self, key: str, value: bytes) -> None:
        with self._lock:
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_set_result, future, value)


def _set_result(future: asyncio.Future, value: bytes) -> None:
    if not future.done():  # a waiter that timed out or was cancelled has gone
        future.set_result(value)
