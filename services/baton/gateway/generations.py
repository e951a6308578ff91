"""One generation through the gateway, whatever door it came in by (gRPC or HTTP).

``Generations.generate`` admits a request (checks it, routes it, records where it lives)
and yields its steps as the relay streams them; the doors only translate. Admission
errors are raised before the first step (``baton.errors`` or ``ValueError``: the caller's
status comes from ``convert.status_for``); a pod's failure that no other pod could take
over is raised as ``Passed`` with the pod's status. An Abort ends the stream with a last
step whose finish reason is ABORTED. A caller that goes away (its task cancelled, or the
generator closed before its end) has the request aborted on every pod that holds state
for it, in the background: nothing is awaited on the way out.

Runs on the gateway's event loop; blocking work (tokenizing, the routing store) goes to
the loop's executor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from baton import tracing
from baton.api import convert
from baton.api.requests import (
    FinishReason,
    GenerateRequest,
    GenerationStep,
    Route,
    Timings,
    tenant_salt,
)
from baton.errors import Passed, PermissionDenied
from baton.gateway.relay import ChainIncomplete, Relay
from baton.gateway.request_table import LiveRequest, RequestTable
from baton.gateway.routing_policy import (
    NoLiveWorkers,
    RouteDecision,
    RoutedPrompt,
    RoutingPolicy,
    WorkersFull,
    prefill_route_of,
)
from baton.gateway.served_model import ServedModel
from baton.logs import log_request, request_log_enabled
from baton.metrics import GatewayMetrics
from baton.routing import RequestRecord, RoutingView, WorkerInfo


class StreamClock:
    """The gateway's own timings of one stream: TTFT and the gaps between messages."""

    def __init__(self, metrics: GatewayMetrics, path: str, arrival: float) -> None:
        self.metrics = metrics
        self.path = path
        self.arrival = arrival  # time.monotonic() when the call reached the gateway
        self.first_token_at: float | None = None
        self.last_token_at = self.arrival
        self.num_gaps = 0
        self.num_tokens = 0  # generated tokens streamed

    def stamp(self, step: GenerationStep) -> GenerationStep:
        now = time.monotonic()
        if step.token_ids:
            self.num_tokens += len(step.token_ids)
            if self.first_token_at is None:
                self.first_token_at = now
                self.metrics.ttft_s.labels(path=self.path).observe(now - self.arrival)
            else:
                self.metrics.time_between_tokens_s.observe(now - self.last_token_at)
                self.num_gaps += 1
            self.last_token_at = now
        if step.finish_reason is None:
            return step
        if step.usage is not None and step.usage.kv_bytes_shipped:
            self._observe_pushed(now)
        return dataclasses.replace(step, timings=self._summary(step.timings or Timings(), now))

    def _observe_pushed(self, now: float) -> None:
        """vLLM's request latencies of a request whose KV a chain pushed: its decode pod saw
        only the push arrive (it observes those of the prompts it prefills itself)."""
        if self.first_token_at is not None:
            self.metrics.vllm.ttft_s.observe(self.first_token_at - self.arrival)
        self.metrics.vllm.e2e_s.observe(now - self.arrival)

    def _summary(self, downstream: Timings, now: float) -> Timings:
        ttft_s = (self.first_token_at or now) - self.arrival
        decoding_s = self.last_token_at - (self.first_token_at or self.last_token_at)
        return Timings(queue_s=downstream.queue_s, ttft_s=ttft_s, prefill_s=downstream.prefill_s,
                       kv_push_s=downstream.kv_push_s,
                       mean_time_between_tokens_s=decoding_s / self.num_gaps if self.num_gaps else 0.0,
                       total_s=now - self.arrival)


class Generations:
    def __init__(self, model: ServedModel, view: RoutingView, policy: RoutingPolicy,
                 table: RequestTable, relay: Relay, metrics: GatewayMetrics) -> None:
        self.model = model
        self.view = view
        self.policy = policy
        self.table = table
        self.relay = relay
        self.metrics = metrics
        self.draining = False
        self._background: set[asyncio.Future] = set()
        self._view_read = asyncio.Event()  # set (and replaced) at each read of the store

    async def generate(self, request: GenerateRequest, arrival: float, owner: str = "",
                       made_id: bool = False, traceparent: str = "") -> AsyncIterator[GenerationStep]:
        """The request's steps; the first names the request id (``arrival`` is when it reached
        the gateway, ``time.monotonic()``: TTFT counts from there; ``owner``, the caller's API
        key name, is the only identity that may abort it; ``made_id``: the door made the
        request's id, so it is live nowhere else; ``traceparent``: the caller's W3C trace
        context, "" = a new trace when tracing is on)."""
        loop = asyncio.get_running_loop()
        span = tracing.start("baton.gateway.request", traceparent, arrival, server=True)
        try:
            live, prompt_ids, decision = await self._admit_when_a_pod_is_live(request, owner, made_id,
                                                                              span)
        except Exception as e:
            self.count_refused(e)
            tracing.end(span, error=e)
            raise
        if span is not None:
            live.traceparent = tracing.traceparent(span)
            tracing.record("baton.gateway.admit", span, arrival, time.monotonic(),
                           {"baton.request_id": live.request_id,
                            "baton.prompt_tokens": len(prompt_ids)})
        # Its record is written while it runs; the client learns the id from the first step,
        # so the store must hold it by then (an Abort may go to another gateway replica).
        recorded = (None if live.recorded.is_set() else
                    loop.run_in_executor(None, self.table.record, live))
        path = "local" if decision.chain is None else "chain"
        clock = StreamClock(self.metrics, path, arrival)
        self.metrics.requests_in_flight.inc()
        outcome = "INTERNAL"
        first = True
        try:
            try:
                async for step in self.relay.stream(live, request, prompt_ids, decision,
                                                    self._reroute, self._reroute_chain):
                    step = clock.stamp(step)
                    if step.token_ids:
                        live.prefilled = True
                    if step.finish_reason is not None:
                        live.completed = True
                        outcome = step.finish_reason.value
                        self._record_usage(step)
                    if first or step.request_id:  # named once (a moved stream's pod names it again)
                        step = dataclasses.replace(step, request_id=live.request_id if first else "")
                    if recorded is not None:
                        await recorded
                        recorded = None
                    first = False
                    yield step
            except (grpc.RpcError, asyncio.CancelledError) as e:
                # An aio call cancelled here (an Abort cancels the request's downstream calls)
                # raises CancelledError in its reader; the caller's own cancellation (it went
                # away) is told apart by the task's pending cancellation.
                if isinstance(e, asyncio.CancelledError) and (
                        not live.aborted.is_set() or asyncio.current_task().cancelling()):
                    raise
                if not live.aborted.is_set():
                    outcome = e.code().name
                    raise Passed(e.code().name, f"{live.request_id}: {e.details()}") from None
                outcome = FinishReason.ABORTED.value
                route = Route(decode_address=live.record.decode_address, chain_id=live.record.chain_id)
                yield clock.stamp(GenerationStep(live.request_id, finish_reason=FinishReason.ABORTED,
                                                 route=route))
            except ChainIncomplete as e:
                outcome = convert.status_for(e).name
                raise
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away
            if not live.completed:  # (a caller may close the stream after its last step)
                outcome = grpc.StatusCode.CANCELLED.name
            raise
        finally:
            # Cancelled, failed or closed before its end: the pods still hold the request;
            # abort it there. Nothing is awaited here, so this runs as well when the stream
            # is closed from outside.
            if not live.completed and not live.aborted.is_set():
                self._in_background(self._abort(live))
            if recorded is not None:  # it ended before its first step
                self._in_background(recorded)
            self._in_background(loop.run_in_executor(None, self.table.finish, live.request_id))
            self.metrics.requests_in_flight.dec()
            self.metrics.requests_finished.labels(path=path, outcome=outcome).inc()
            if span is not None or request_log_enabled():
                _log_and_trace(span, live, clock, outcome)

    def count_refused(self, error: Exception) -> None:
        """A request refused before it was routed (a door's own checks call this too)."""
        self.metrics.requests_finished.labels(path="none", outcome=convert.status_for(error).name).inc()

    async def abort(self, request_id: str, caller: str = "") -> bool:
        """End a request wherever it runs (this gateway's stream, or another gateway's through
        the routing store); True when some pod held it. Raises PermissionDenied when the
        request belongs to another API key than ``caller``'s (it is left running)."""
        live = self.table.get(request_id)
        record = live.record if live is not None else await asyncio.get_running_loop(
            ).run_in_executor(None, self.table.find_record, request_id)
        if record is None:
            return False
        if record.owner != caller:
            raise PermissionDenied(f"request {request_id!r} was sent with another API key; only "
                                   f"that key may abort it")
        if live is not None:
            return await self._abort(live)
        return await self.relay.abort_pods(record)

    # --- admission and rerouting -------------------------------------------------------------

    async def _admit_when_a_pod_is_live(self, request: GenerateRequest, owner: str,
                                        made_id: bool = False, span=None):
        """Admit the request; while no decode pod is live (one restarting after a crash), wait
        up to ``reroute_wait_s`` for one, as a request that lost its pod does. ``span``: the
        request's trace span, the parent of the routing decision's."""
        loop = asyncio.get_running_loop()
        try:
            return await self._until_a_pod_is_live(
                lambda: loop.run_in_executor(None, self._admit, request, owner, made_id, span),
                (NoLiveWorkers,),
                give_up_when_draining=True)
        except NoLiveWorkers as e:
            raise NoLiveWorkers(f"{e} (waited {self.relay.config.reroute_wait_s:g} s for one)") from None

    def look_again(self) -> None:
        """Requests waiting for a live pod try again: the routing store was read again (the
        gateway's view reader), or the gateway drains (they give up). Event-loop thread."""
        event, self._view_read = self._view_read, asyncio.Event()
        event.set()

    async def _until_a_pod_is_live(self, attempt, retried: tuple[type[Exception], ...],
                                   give_up_when_draining: bool = False):
        """``await attempt()`` again after each read of the store while it raises one of
        ``retried``, for ``reroute_wait_s`` at most (then its last error is raised)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.relay.config.reroute_wait_s
        while True:
            read = self._view_read
            try:
                return await attempt()
            except retried:
                if loop.time() >= deadline or (give_up_when_draining and self.draining):
                    raise
            try:  # the store cannot notify: the view reader's next read is the next chance
                await asyncio.wait_for(read.wait(), deadline - loop.time())
            except TimeoutError:
                pass

    def _admit(self, request: GenerateRequest, owner: str, made_id: bool = False, span=None
               ) -> tuple[LiveRequest, tuple[int, ...], RouteDecision]:
        if self.draining:
            raise NoLiveWorkers("the gateway is shutting down")
        prompt_ids = self.model.prompt_ids(request)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        pinned = prefill_route_of(request)
        routing_began = time.monotonic()
        try:
            snapshot = self._snapshot()
            salt = tenant_salt(owner, request.cache_salt)
            routed = RoutedPrompt(tuple(prompt_ids), salt, whole_kv=request.compression.enabled is False)
            decision = self.policy.route(len(prompt_ids), snapshot, self.table.in_flight(), pinned,
                                         routed)
            if (decision.chain is None and pinned == "auto" and not self.policy.chain_heads(snapshot)
                    and len(prompt_ids) >= self.policy.config.prefill_threshold_tokens):
                raise NoLiveWorkers("no chain in the view")
        except NoLiveWorkers:
            # The view may predate a pod or a chain that registered since (right after
            # start-up): one fresh read of the store before the caller is told there is no
            # pod, or a long prompt is prefilled without a chain.
            decision = self.policy.route(len(prompt_ids), self._snapshot(fresh=True),
                                         self.table.in_flight(), pinned,
                                         RoutedPrompt(tuple(prompt_ids), salt,
                                                      request.compression.enabled is False))
        if span is not None:
            tracing.record("baton.gateway.route", span, routing_began, time.monotonic(),
                           _route_attributes(decision, pinned))
        record = RequestRecord(request_id=request_id, decode_address=decision.decode.address,
                               chain_id=decision.chain.chain_id if decision.chain else "",
                               prefill_address=decision.chain.address if decision.chain else "",
                               owner=owner)
        live = self.table.admit(record, len(prompt_ids), new_id=made_id or not request.request_id,
                                cached_tokens=decision.cached_tokens)
        return live, prompt_ids, decision

    async def _reroute(self, num_prompt_tokens: int, exclude: frozenset[str]) -> WorkerInfo:
        """A live decode pod for a request whose pod failed, none whose address or incarnation
        is in ``exclude``; waits (re-reading the store) up to ``reroute_wait_s`` for one to
        appear, e.g. the failed pod restarted at a new address. Raises NoLiveWorkers when
        none came."""
        loop = asyncio.get_running_loop()

        async def attempt() -> WorkerInfo:
            snapshot = await loop.run_in_executor(None, self._snapshot, True)
            snapshot = dataclasses.replace(snapshot, workers=tuple(
                worker for worker in snapshot.workers
                if worker.address not in exclude and worker.incarnation not in exclude))
            return self.policy.route(num_prompt_tokens, snapshot, self.table.in_flight()).decode

        return await self._until_a_pod_is_live(attempt, (NoLiveWorkers, WorkersFull))

    async def _reroute_chain(self, num_prompt_tokens: int, exclude: frozenset[str]) -> RouteDecision:
        """A live chain, and a decode pod for it, for a request pinned to a chain that failed
        it: none whose incarnation is in ``exclude``. Waits (re-reading the store) up to
        ``reroute_wait_s`` for one, e.g. the failed chain restarted; raises NoLiveWorkers when
        none came."""
        loop = asyncio.get_running_loop()

        async def attempt() -> RouteDecision:
            snapshot = await loop.run_in_executor(None, self._snapshot, True)
            snapshot = dataclasses.replace(snapshot, workers=tuple(
                worker for worker in snapshot.workers if worker.incarnation not in exclude))
            return self.policy.route(num_prompt_tokens, snapshot, self.table.in_flight(), "chain")

        return await self._until_a_pod_is_live(attempt, (NoLiveWorkers, WorkersFull))

    def _snapshot(self, fresh: bool = False):
        snapshot = self.view.snapshot(fresh)
        self.metrics.routing_view_stale.set(1 if snapshot.stale else 0)
        if snapshot.prefixes is not None and snapshot.prefixes.last_refresh_s:
            self.metrics.prefix_index_age_s.set(max(0.0, time.time() - snapshot.prefixes.last_refresh_s))
        for role in ("decode", "prefill"):
            self.metrics.live_workers.labels(role=role).set(len(snapshot.of_role(role)))
        return snapshot

    # --- helpers -----------------------------------------------------------------------------

    def _in_background(self, awaitable) -> None:
        """Run without waiting for it; the reference is kept until it ends."""
        task = asyncio.ensure_future(awaitable)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _record_usage(self, step: GenerationStep) -> None:
        if step.usage is None:
            return
        self.metrics.record_lengths(step.usage.prompt_tokens, step.usage.completion_tokens)
        self.metrics.kv_bytes_shipped.inc(step.usage.kv_bytes_shipped)
        if step.usage.kv_tokens_full:
            self.metrics.compression_ratio.observe(step.usage.kv_tokens_kept / step.usage.kv_tokens_full)

    async def _abort(self, live: LiveRequest) -> bool:
        live.aborted.set()
        found = await self.relay.abort_pods(live.record)
        live.cancel_calls()
        return found



def _route_attributes(decision: RouteDecision, pinned: str) -> dict[str, object]:
    return {"baton.route.path": "local" if decision.chain is None else "chain",
            "baton.route.reason": decision.reason, "baton.route.pinned": pinned,
            "baton.route.decode": decision.decode.address,
            "baton.route.chain": decision.chain.chain_id if decision.chain else "",
            "baton.route.cached_tokens": decision.cached_tokens}


def _log_and_trace(span, live: LiveRequest, clock: StreamClock, outcome: str) -> None:
    """The request's line in the request log (when on) and the end of its span (when traced):
    the same fields in both."""
    now = time.monotonic()
    record = live.record
    fields = {"id": live.request_id, "route": "chain" if record.chain_id else "local",
              "chain": record.chain_id, "decode": record.decode_address, "outcome": outcome,
              "prompt_tokens": live.num_prompt_tokens, "completion_tokens": clock.num_tokens,
              "ttft_s": (clock.first_token_at - clock.arrival) if clock.first_token_at else None,
              "total_s": now - clock.arrival}
    if request_log_enabled():
        log_request(fields)
    if span is not None:
        tracing.end(span, now, {f"baton.{key}": value for key, value in fields.items()
                                if value is not None})

