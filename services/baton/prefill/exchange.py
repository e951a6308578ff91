"""Rank 0 <-> tail: per-request details and events through the chain's rendezvous store.

Why this path: the chain broadcasts only what every rank computes with (op, numeric id,
partition, token ids). The tail alone also needs the request's string id, sampling and
compression settings and the decode pod's address, and rank 0 alone needs what the tail
learns (the first token, then "shipped" or an error). Every rank already reaches rank 0's
``TCPStore`` (the ``tcp://master_addr:master_port`` rendezvous of the process group), a
key-value store whose ``get`` blocks until a key exists: rank 0 writes
``request/<id>`` before it queues the request, the tail reads it, and the tail writes
``first/<id>`` and ``done/<id>`` that rank 0's gRPC handler is blocked on. No new port, no
new protocol, and the chain's collectives stay untouched.

Values: the request is its ``PrefillRequest`` protobuf; events are JSON (``{"error": ...}``
with a gRPC status name for failures). Each thread keeps its own store client (handlers run
on many threads; a client is one TCP connection).
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import torch.distributed as dist

from baton.api import convert
from baton.api.requests import PrefillRequest
from baton.api.v1 import prefill_pb2

KEY_PREFIX = "baton/prefill"


class ChainEventTimeout(Exception):
    """The tail did not report in time (the chain is stuck or gone)."""


class ChainExchange:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._local = threading.local()

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
        self._store(10.0).set(self._key("request", chain_request_id), message.SerializeToString())

    def wait_event(self, chain_request_id: int, kind: str, timeout_s: float) -> dict:
        """Block until the tail reports ``kind`` ("first" or "done") for the request."""
        try:
            value = self._store(timeout_s).get(self._key(kind, chain_request_id))
        except RuntimeError as e:  # the store's timeout (DistStoreError) or a lost connection
            raise ChainEventTimeout(f"the chain's tail did not report {kind!r} for request "
                                    f"{chain_request_id} within {timeout_s:g} s: {e}") from e
        return json.loads(value)

    def abort(self, chain_request_id: int) -> None:
        self._store(10.0).set(self._key("abort", chain_request_id), b"1")

    def forget(self, chain_request_id: int) -> None:
        store = self._store(10.0)
        for kind in ("request", "first", "done", "abort"):
            store.delete_key(self._key(kind, chain_request_id))

    # --- the tail (and rank 0 when it reports a broken chain) ---------------------------

    def read_request(self, chain_request_id: int, timeout_s: float) -> PrefillRequest:
        value = self._store(timeout_s).get(self._key("request", chain_request_id))
        message = prefill_pb2.PrefillRequest()
        message.ParseFromString(value)
        return convert.prefill_request_from_proto(message)

    def is_aborted(self, chain_request_id: int) -> bool:
        return self._store(10.0).check([self._key("abort", chain_request_id)])

    def report(self, chain_request_id: int, kind: str, event: dict) -> None:
        self._store(10.0).set(self._key(kind, chain_request_id), json.dumps(event))

    def report_error(self, chain_request_id: int, code: str, message: str) -> None:
        """Fail the request on rank 0, whichever event it is waiting for."""
        event = {"error": {"code": code, "message": message}}
        for kind in ("first", "done"):
            key = self._key(kind, chain_request_id)
            if not self._store(10.0).check([key]):
                self.report(chain_request_id, kind, event)
