"""Rank 0 of a prefill chain: the Prefill gRPC service and the chain's request source.

A Prefill call is validated here (bad input never reaches the chain), numbered, described to
the tail through the ``ChainExchange`` and queued; the chain loop takes it from the queue
(``next_request``) and broadcasts it. The handler (a coroutine on the server's event loop:
a waiting request holds no thread) then waits for the tail's two events through the
``EventPump`` and streams them: the first token (with the partition used), then "shipped"
once the decode pod holds the KV. A request aborted while queued never reaches the chain; one aborted in flight
is not shipped (the tail checks before pushing).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from baton.api import convert
from baton.api.requests import PrefillFirstToken, PrefillRequest, PrefillShipped
from baton.api.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from baton.config import MtlsConfig
from baton.errors import AlreadyExists, PermissionDenied, ResourceExhausted, Unavailable
from baton.metrics import PrefillMetrics
from baton.model.config import ModelConfig
from baton.model.limits import check_prompt
from baton.mtls import Mtls, require_role
from baton.prefill.exchange import ChainEventTimeout, ChainExchange, EventPump
from baton.routing.store import WorkerLoad
from baton.runahead.partition import even_boundaries
from baton.runahead.request import ChainRequest, make_request
from baton.runahead.table import PartitionTable
from baton.runahead.worker import StopChain

log = logging.getLogger(__name__)


@dataclass
class Pending:
    request: PrefillRequest
    chain_request: ChainRequest
    taken: bool = False  # the chain loop has broadcast it
    cancelled: bool = False  # aborted while queued: skipped by the chain loop


class DuplicateRequest(AlreadyExists):
    """A live request already has this id (gRPC ALREADY_EXISTS)."""


class PrefillFrontend(prefill_pb2_grpc.PrefillServicer):
    """Rank 0's servicer and ``RequestSource``; UNAVAILABLE until the chain is ready."""

    def __init__(self, exchange: ChainExchange, model_config: ModelConfig, model_id: str,
                 num_ranks: int, mode: str, table: PartitionTable | None,
                 metrics: PrefillMetrics, timeout_s: float, max_queued_requests: int = 1024,
                 mtls: Mtls | None = None) -> None:
        self.mtls = mtls or Mtls(MtlsConfig())
        # Set once the routing store is open: raises PermissionDenied for an address that is
        # not a registered decode pod (the tail would otherwise connect wherever it is told).
        self.check_decode: Callable[[str], None] | None = None
        self.exchange = exchange
        self.model_config = model_config
        self.model_id = model_id
        self.num_ranks = num_ranks
        self.mode = mode
        self.table = table if mode == "runahead" else None  # TSP always runs even slices
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.max_queued_requests = max_queued_requests
        self.unavailable: str | None = "the prefill chain is still starting"
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: dict[str, tuple[int, Pending]] = {}  # request id -> (chain id, pending)
        self._chain_ids = itertools.count()
        self.events = EventPump(exchange)

    # --- chain side ------------------------------------------------------------------------

    def next_request(self, timeout_s: float) -> ChainRequest | None:
        try:
            pending = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if pending is None:
            raise StopChain()
        with self._lock:
            if pending.cancelled:
                return None
            pending.taken = True
        return pending.chain_request

    def stop_chain(self) -> None:
        self._queue.put(None)
        self.events.stop()

    @property
    def load(self) -> WorkerLoad:
        with self._lock:
            pending = [p for _, p in self._live.values()]
        return WorkerLoad(queued_requests=len(pending),
                          queued_prompt_tokens=sum(len(p.request.prompt_token_ids) for p in pending))

    # --- RPCs ------------------------------------------------------------------------------

    async def _require(self, context, roles: tuple[str, ...], what: str) -> None:
        try:
            require_role(context, self.mtls, roles, what)
        except PermissionDenied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def Prefill(self, request, context) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        await self._require(context, ("gateway",), "Prefill")
        if self.unavailable is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable)
        arrival_s = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            prefill_request = convert.prefill_request_from_proto(request)
            chain_id, _pending = await loop.run_in_executor(None, self._admit, prefill_request)
        except Exception as e:  # noqa: BLE001 - the caller's input: its status names the value
            await context.abort(convert.status_for(e), str(e))
        try:
            first = await self._event(chain_id, "first", context)
            ttft_s = time.monotonic() - arrival_s
            self.metrics.ttft_s.observe(ttft_s)
            yield convert.prefill_event_to_proto(PrefillFirstToken(
                prefill_request.request_id, first["token_id"], ttft_s, tuple(first["partition"])))
            done = await self._event(chain_id, "done", context)
            yield convert.prefill_event_to_proto(PrefillShipped(prefill_request.request_id, **done))
        finally:
            # not awaited: this also runs when the call is cancelled
            loop.run_in_executor(None, self._retire, prefill_request.request_id, chain_id)

    async def Abort(self, request, context) -> common_pb2.AbortResponse:
        await self._require(context, ("gateway",), "Abort")
        with self._lock:
            entry = self._live.get(request.request_id)
            if entry is not None:
                chain_id, pending = entry
                pending.cancelled = not pending.taken
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} on this prefill chain")
        loop = asyncio.get_running_loop()
        if pending.cancelled:  # still queued: it never reaches the chain
            await loop.run_in_executor(None, self.exchange.report_error, chain_id, "ABORTED",
                                       f"request {request.request_id!r} was aborted")
        else:  # in the chain: the tail does not ship it
            await loop.run_in_executor(None, self.exchange.abort, chain_id)
        return common_pb2.AbortResponse(found=True)

    async def Stats(self, request, context) -> common_pb2.WorkerLoad:
        await self._require(context, ("gateway", "prefill", "decode"), "Stats")
        return convert.worker_load_to_proto(self.load)

    # --- helpers ---------------------------------------------------------------------------

    def _admit(self, request: PrefillRequest) -> tuple[int, Pending]:
        if request.model and request.model != self.model_id:
            raise ValueError(f"unknown model {request.model!r}; this chain serves {self.model_id!r}")
        check_prompt(request.prompt_token_ids, request.sampling, self.model_config.vocab_size,
                     self.model_config.max_position_embeddings)
        if self.check_decode is None:
            raise Unavailable("the chain is not ready")
        self.check_decode(request.decode_address)
        context_length = len(request.prompt_token_ids)
        boundaries = (self.table.boundaries(self.num_ranks, context_length) if self.table
                      else even_boundaries(context_length, self.num_ranks))
        with self._lock:
            queued = sum(not pending.taken for _, pending in self._live.values())
            if queued >= self.max_queued_requests:
                raise ResourceExhausted(f"{queued} requests wait in this chain's queue, at most "
                                        f"{self.max_queued_requests}; retry, or prefill elsewhere")
            if request.request_id in self._live:
                raise DuplicateRequest(f"request id {request.request_id!r} is already live on this chain")
            chain_id = next(self._chain_ids)
            pending = Pending(request, make_request(chain_id, request.prompt_token_ids,
                                                    self.num_ranks, self.model_config, boundaries,
                                                    self.mode))
            self._live[request.request_id] = (chain_id, pending)
        self.exchange.publish_request(chain_id, request)
        self._queue.put(pending)
        self._publish_load()
        return chain_id, pending

    async def _event(self, chain_id: int, kind: str, context) -> dict:
        try:
            event = await self.events.wait(chain_id, kind, self.timeout_s)
        except ChainEventTimeout as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if "error" in event:
            await context.abort(grpc.StatusCode[event["error"]["code"]], event["error"]["message"])
        return event

    def _retire(self, request_id: str, chain_id: int) -> None:
        with self._lock:
            self._live.pop(request_id, None)
        self.exchange.forget(chain_id)
        self._publish_load()

    def _publish_load(self) -> None:
        load = self.load
        self.metrics.queued_requests.set(load.queued_requests)
        self.metrics.queued_prompt_tokens.set(load.queued_prompt_tokens)

    def fail_all(self, message: str) -> None:
        """The chain broke: every request waiting on it fails (UNAVAILABLE)."""
        self.unavailable = f"the prefill chain is down: {message}"
        with self._lock:
            entries = list(self._live.values())
        for chain_id, _ in entries:
            self.exchange.report_error(chain_id, "UNAVAILABLE", self.unavailable)
