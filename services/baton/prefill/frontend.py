"""Rank 0 of a prefill chain: the Prefill gRPC service and the chain's request source.

A Prefill call is validated here (bad input never reaches the chain), numbered and queued;
the chain loop takes it from the queue (``next_request``) and broadcasts it with its
details (the serialized ``PrefillRequest``, which only the tail reads). The handler (a
coroutine on the server's event loop: a waiting request holds no thread) answers one
message when the chain starts the request, then holds the call open while the chain may
still hold the request: a broken chain fails it (UNAVAILABLE), so the caller learns at
once that no KV will come. The tokens themselves never pass here: the tail pushes the
first token with the KV to the decode pod, the caller's one stream. A request aborted
while queued never reaches the chain; one aborted in flight is refused by the decode pod
it was meant for.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from baton import tracing
from baton.api import convert
from baton.api.requests import PrefillRequest, PrefillStarted
from baton.api.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from baton.config import MtlsConfig, ServerConfig
from baton.errors import Aborted, AlreadyExists, PermissionDenied, ResourceExhausted, Unavailable
from baton.metrics import PrefillMetrics
from baton.model.config import ModelConfig
from baton.routing.store import WorkerLoad
from baton.runahead.partition import even_boundaries
from baton.runahead.request import ChainRequest, make_request
from baton.runahead.table import PartitionTable
from baton.runahead.worker import StopChain
from baton.sampling.limits import check_prompt
from baton.security.mtls import Mtls, require_role
from baton.transfer.sender import PUSH_TIMEOUT_S

log = logging.getLogger(__name__)

# Who sends a chain prompts: gateways, and decode pods serving their own OpenAI door (an
# InferencePool endpoint), which push to themselves (``baton.decode.door``).
CALLERS = ("gateway", "decode")


@dataclass
class Pending:
    """A request at rank 0, from admission until its caller lets go of it."""

    request: PrefillRequest
    chain_request: ChainRequest
    loop: asyncio.AbstractEventLoop
    arrival_s: float = field(default_factory=time.monotonic)
    started: asyncio.Future = None  # the chain took it (queue seconds), or why it never will
    over: asyncio.Future = None  # only ever fails: the chain broke while holding it
    taken: bool = False  # the chain loop has broadcast it
    cancelled: bool = False  # aborted while queued: skipped by the chain loop

    def __post_init__(self) -> None:
        self.started = self.loop.create_future()
        self.over = self.loop.create_future()

    def resolve(self, future: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        """Settle one of its futures from any thread."""
        self.loop.call_soon_threadsafe(_settle, future, value, error)


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class DuplicateRequest(AlreadyExists):
    """A live request already has this id (gRPC ALREADY_EXISTS)."""


class PrefillFrontend(prefill_pb2_grpc.PrefillServicer):
    """Rank 0's servicer and ``RequestSource``; UNAVAILABLE until the chain is ready."""

    def __init__(self, model_config: ModelConfig, model_id: str,
                 num_ranks: int, mode: str, table: PartitionTable | None,
                 metrics: PrefillMetrics, timeout_s: float,
                 max_queued_requests: int = ServerConfig.max_queued_requests,
                 mtls: Mtls | None = None) -> None:
        self.mtls = mtls or Mtls(MtlsConfig())
        # Set once the routing store is open: raises PermissionDenied for an address that is
        # not a registered decode pod (the tail would otherwise connect wherever it is told).
        self.check_decode: Callable[[str], None] | None = None
        self.model_config = model_config
        self.model_id = model_id
        self.num_ranks = num_ranks
        self.mode = mode
        self.table = table if mode == "runahead" else None  # TSP always runs even slices
        self.metrics = metrics
        self.timeout_s = timeout_s
        # How long after its start a request may still be in the chain's hands: its compute
        # (bounded by the chain's timeout, past which a rank gives up) and its push.
        self.held_s = timeout_s + PUSH_TIMEOUT_S
        self.max_queued_requests = max_queued_requests
        self.unavailable: str | None = "the prefill chain is still starting"
        # (priority, order, entry): lower priority values first (vLLM's rule), then arrival;
        # the stop sign (None) ahead of everything
        self._queue: queue.PriorityQueue[tuple[float, int, Pending | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[str, Pending] = {}  # request id -> its pending entry
        self._chain_ids = itertools.count()

    # --- chain side ------------------------------------------------------------------------

    def next_request(self, timeout_s: float) -> ChainRequest | None:
        try:
            _, _, pending = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if pending is None:
            raise StopChain()
        with self._lock:
            if pending.cancelled:
                return None
            pending.taken = True
        pending.resolve(pending.started, time.monotonic() - pending.arrival_s)
        return pending.chain_request

    def stop_chain(self) -> None:
        self._queue.put((float("-inf"), next(self._order), None))

    @property
    def load(self) -> WorkerLoad:
        with self._lock:
            pending = list(self._live.values())
        return WorkerLoad(queued_requests=len(pending),
                          queued_prompt_tokens=sum(len(p.request.prompt_token_ids) for p in pending))

    # --- RPCs ------------------------------------------------------------------------------

    async def _require(self, context, roles: tuple[str, ...], what: str) -> None:
        try:
            require_role(context, self.mtls, roles, what)
        except PermissionDenied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))

    async def Prefill(self, request, context) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        await self._require(context, CALLERS, "Prefill")
        if self.unavailable is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.unavailable)
        loop = asyncio.get_running_loop()
        try:
            prefill_request = convert.prefill_request_from_proto(request)
            pending = await loop.run_in_executor(None, self._admit, prefill_request, loop)
        except Exception as e:  # noqa: BLE001 - the caller's input: its status names the value
            await context.abort(convert.status_for(e), str(e))
        try:
            try:
                queue_s = await pending.started
                self.metrics.queue_s.observe(queue_s)
                if prefill_request.traceparent:
                    tracing.record("baton.prefill.queue", prefill_request.traceparent,
                                   pending.arrival_s, pending.arrival_s + queue_s,
                                   {"baton.request_id": prefill_request.request_id})
                yield convert.prefill_started_to_proto(PrefillStarted(
                    prefill_request.request_id, tuple(pending.chain_request.boundaries), queue_s))
                await asyncio.wait_for(asyncio.shield(pending.over), self.held_s)
            except TimeoutError:
                return  # past any time the chain could still hold it
            except Exception as e:  # noqa: BLE001 - aborted while queued, or the chain broke
                await context.abort(convert.status_for(e), str(e))
        finally:
            with self._lock:  # also when the call is cancelled
                self._live.pop(prefill_request.request_id, None)
                pending.cancelled = not pending.taken  # a caller gone before the chain took it
            for future in (pending.started, pending.over):
                future.cancel()  # settled later (a chain failure) it stays silent
            self._publish_load()

    async def Abort(self, request, context) -> common_pb2.AbortResponse:
        await self._require(context, CALLERS, "Abort")
        with self._lock:
            pending = self._live.get(request.request_id)
            if pending is not None:
                pending.cancelled = not pending.taken
        if pending is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} on this prefill chain")
        if pending.cancelled:  # still queued: it never reaches the chain
            pending.resolve(pending.started, error=Aborted(
                f"request {request.request_id!r} was aborted"))
        # In the chain: the decode pod it was meant for refuses its push once the caller
        # aborts the request there too.
        return common_pb2.AbortResponse(found=True)

    async def Stats(self, request, context) -> common_pb2.WorkerLoad:
        await self._require(context, ("gateway", "prefill", "decode"), "Stats")
        return convert.worker_load_to_proto(self.load)

    # --- helpers ---------------------------------------------------------------------------

    def _admit(self, request: PrefillRequest, loop: asyncio.AbstractEventLoop) -> Pending:
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
        details = convert.prefill_request_to_proto(request).SerializeToString()
        with self._lock:
            queued = sum(not pending.taken for pending in self._live.values())
            if queued >= self.max_queued_requests:
                raise ResourceExhausted(f"{queued} requests wait in this chain's queue, at most "
                                        f"{self.max_queued_requests}; retry, or prefill elsewhere")
            if request.request_id in self._live:
                raise DuplicateRequest(f"request id {request.request_id!r} is already live on this chain")
            pending = Pending(request, make_request(next(self._chain_ids), request.prompt_token_ids,
                                                    self.num_ranks, self.model_config, boundaries,
                                                    self.mode, details=details), loop)
            self._live[request.request_id] = pending
        self._queue.put((request.sampling.priority, next(self._order), pending))
        self._publish_load()
        return pending

    def _publish_load(self) -> None:
        load = self.load
        self.metrics.queued_requests.set(load.queued_requests)
        self.metrics.queued_prompt_tokens.set(load.queued_prompt_tokens)

    def fail_all(self, message: str) -> None:
        """The chain broke: every request waiting on it fails (UNAVAILABLE)."""
        self.unavailable = f"the prefill chain is down: {message}"
        with self._lock:
            entries = list(self._live.values())
        for pending in entries:
            pending.resolve(pending.started, error=Unavailable(self.unavailable))
            pending.resolve(pending.over, error=Unavailable(self.unavailable))
