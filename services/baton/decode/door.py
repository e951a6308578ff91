"""A decode pod's own OpenAI door: what makes it a Gateway API Inference Extension endpoint.

An ``InferencePool`` sends each request straight to the pod its endpoint picker chose, so
the pod must answer OpenAI Completions and Chat itself (``--http-port``). The door is the
gateway's (``baton.gateway.http.OpenAIServer``: the same parsing, checks, answers and
streams); what differs is the router behind it, ``PodRouter``, which plays the gateway's
``Generations`` for this one pod:

* a request is checked by the gateway's ``ServedModel`` and routed by the gateway's policy
  (``create_policy``: the same threshold, break-even and chain queue limit), over a view
  whose only decode pod is this one, with its live load, beside the chains of the store;
* a short prompt (or one whose prefix this pod's cache holds) is submitted to this pod's
  worker in-process and streamed as its Generate would be;
* a long one goes to a chain's rank 0 (``Prefill``, over the same mTLS as every internal
  hop, with this pod's certificate) naming this pod; the tail pushes the KV here, and the
  stream is this pod's Attach, in-process. A chain that fails it before its first token
  has it prefilled here (``gateway.chain_failure: recompute``), as the gateway does.

What the door cannot do that the gateway does: move a stream when this pod dies (the pod
is the stream's only end), pick another pod, or read the other pods' caches; the endpoint
picker chose the pod and owns those choices (docs/operations.md, "Gateway API Inference
Extension").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from baton.api import convert
from baton.api.requests import (
    DecodeRequest,
    GenerateRequest,
    GenerationStep,
    PrefillRequest,
    Route,
    tenant_salt,
)
from baton.api.v1 import decode_pb2
from baton.config import KV_TRANSPORTS, DecodeServiceConfig
from baton.decode.servicer import DecodeServicer
from baton.decode.streams import RequestStream
from baton.errors import Unavailable
from baton.gateway.channels import Channels
from baton.gateway.http import OpenAIServer
from baton.gateway.http.chat_template import ChatTemplate
from baton.gateway.relay import POD_FAILURES, ChainIncomplete, chain_event, until_the_call_ends
from baton.gateway.routing_policy import (
    InFlight,
    RouteDecision,
    RoutedPrompt,
    create_policy,
    prefill_route_of,
)
from baton.gateway.served_model import ServedModel
from baton.metrics import DecodeMetrics
from baton.routing import RoutingSnapshot, RoutingStore, RoutingView, WorkerInfo
from baton.routing.prefix_index import PrefixIndex
from baton.security.api_keys import ApiKeys
from baton.security.mtls import Mtls

log = logging.getLogger(__name__)


class PodRouter:
    """The door's router on a decode pod (what ``OpenAIServer`` asks of the gateway's
    ``Generations``: ``model``, ``generate``, ``count_refused``). Event-loop side."""

    def __init__(self, config: DecodeServiceConfig, model: ServedModel, store: RoutingStore,
                 servicer: DecodeServicer, describe: Callable[[], WorkerInfo],
                 metrics: DecodeMetrics) -> None:
        """``describe``: this pod's routing record with its live load (the decode server's)."""
        self.config = config.gateway
        self.model = model
        self.servicer = servicer
        self.describe = describe
        self.metrics = metrics
        self.policy = create_policy(config.gateway, model.model_id)
        self.view = RoutingView(store, config.routing.view_refresh_s, prefixes=PrefixIndex())
        self.channels = Channels(Mtls(config.mtls))
        self._chain_in_flight: dict[str, InFlight] = {}  # sent to a chain, not started there

    def count_refused(self, error: Exception) -> None:
        """A request the door refused before it was routed."""
        self.metrics.door_requests_refused.labels(code=convert.status_for(error).name).inc()

    async def generate(self, request: GenerateRequest, arrival: float, owner: str = "",
                       made_id: bool = False, traceparent: str = "") -> AsyncIterator[GenerationStep]:
        """The request's steps, the first naming its id (``Generations.generate``'s
        contract; ``made_id`` is the door's word that the id is new, which this pod checks
        anyway; ``traceparent`` goes on to this pod's and the chain's spans)."""
        loop = asyncio.get_running_loop()
        try:
            prompt_ids, decision = await loop.run_in_executor(None, self._route, request, owner)
        except Exception as e:
            self.count_refused(e)
            raise
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        salt = tenant_salt(owner, request.cache_salt)
        log.debug("request %s: %s", request_id, decision.reason)
        route = Route(decode_address=decision.decode.address,
                      chain_id=decision.chain.chain_id if decision.chain else "",
                      reason=decision.reason)
        if decision.chain is None:
            steps = self._local(request_id, request, prompt_ids, salt, route, traceparent)
        else:
            steps = self._through_chain(request_id, request, prompt_ids, salt, decision, route,
                                        arrival, traceparent)
        async with contextlib.aclosing(steps):
            async for step in steps:
                yield step

    # --- routing ----------------------------------------------------------------------------

    def _route(self, request: GenerateRequest, owner: str) -> tuple[tuple[int, ...], RouteDecision]:
        """The prompt's ids, checked, and where it is prefilled (the executor's: it may read
        the routing store)."""
        prompt_ids = self.model.prompt_ids(request)
        routed = RoutedPrompt(prompt_ids, tenant_salt(owner, request.cache_salt),
                              whole_kv=request.compression.enabled is False)
        decision = self.policy.route(len(prompt_ids), self._snapshot(), dict(self._chain_in_flight),
                                     prefill_route_of(request), routed)
        return prompt_ids, decision

    def _snapshot(self) -> RoutingSnapshot:
        """The store's chains and this pod alone as the decode pod, with its load as of now."""
        seen = self.view.snapshot()
        chains = tuple(worker for worker in seen.workers if worker.role == "prefill")
        return dataclasses.replace(seen, workers=(self.describe(), *chains))

    # --- the two routes ---------------------------------------------------------------------

    async def _local(self, request_id: str, request: GenerateRequest, prompt_ids: tuple[int, ...],
                     salt: str, route: Route, traceparent: str = "") -> AsyncIterator[GenerationStep]:
        """Prefilled and generated here, as a Generate on this pod."""
        stream = await self._open(convert.decode_request_to_proto(DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=request.sampling,
            compression=request.compression, incarnation=self.describe().incarnation,
            cache_salt=salt, traceparent=traceparent)))
        async with contextlib.aclosing(self._steps(stream, route)) as steps:
            async for step in steps:
                yield step

    async def _through_chain(self, request_id: str, request: GenerateRequest,
                             prompt_ids: tuple[int, ...], salt: str, decision: RouteDecision,
                             route: Route, arrival: float,
                             traceparent: str = "") -> AsyncIterator[GenerationStep]:
        """Prefilled by a chain that pushes the KV here; recomputed here when the chain fails
        it before its first token (and the request is not pinned to a chain)."""
        chain = decision.chain
        try:
            steps, first = await self._first_from_chain(request_id, request, prompt_ids, salt,
                                                       decision, route, traceparent)
        except (grpc.RpcError, ChainIncomplete) as e:
            code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
            if (code not in POD_FAILURES or self.config.chain_failure != "recompute"
                    or request.prefill_route == "chain"):
                raise Unavailable(f"chain {chain.chain_id} failed request {request_id!r} "
                                  f"({code.name}): {_describe(e)}") from None
            log.warning("request %s: chain %s failed it (%s); prefilling it here", request_id,
                        chain.chain_id, _describe(e))
            self.servicer.worker.abort(request_id)  # a late push under its id is refused
            here = Route(decode_address=route.decode_address, reason=(
                f"{route.reason}; chain {chain.chain_id} failed it ({code.name}): prefilled on "
                f"the decode pod"))
            async for step in self._local(request_id, request, prompt_ids, salt, here, traceparent):
                yield step
            return
        # vLLM's request latencies of a pushed request are its front end's (this door's)
        self.metrics.vllm.latencies.ttft_s.observe(time.monotonic() - arrival)
        async with contextlib.aclosing(steps):
            yield first
            async for step in steps:
                yield step
        self.metrics.vllm.latencies.e2e_s.observe(time.monotonic() - arrival)

    async def _first_from_chain(self, request_id: str, request: GenerateRequest,
                                prompt_ids: tuple[int, ...], salt: str, decision: RouteDecision,
                                route: Route, traceparent: str = ""
                                ) -> tuple[AsyncIterator[GenerationStep], GenerationStep]:
        """Queue the prompt on the chain; once it has started, attach to the push here and
        take the first token it brings: the stream's steps and that first one. Raises when
        the chain fails first (its call fails)."""
        me = decision.decode
        chain = decision.chain
        call = self.channels.prefill(chain.address).Prefill(convert.prefill_request_to_proto(
            PrefillRequest(request_id=request_id, model=self.model.model_id,
                           prompt_token_ids=prompt_ids, sampling=request.sampling,
                           compression=request.compression, decode_address=me.address,
                           decode_incarnation=me.incarnation, cache_salt=salt,
                           decode_kv_transport=(me.kv_transport if me.kv_transport in KV_TRANSPORTS
                                                else "grpc"), traceparent=traceparent)))
        events = aiter(call)
        queued = self._chain_in_flight.get(chain.address, InFlight())
        self._chain_in_flight[chain.address] = InFlight(queued.requests + 1,
                                                        queued.prompt_tokens + len(prompt_ids))
        try:
            started = await chain_event(events)
        finally:
            left = self._chain_in_flight.pop(chain.address)
            if left.requests > 1:
                self._chain_in_flight[chain.address] = InFlight(
                    left.requests - 1, left.prompt_tokens - len(prompt_ids))
        if started is None:
            raise ChainIncomplete(f"chain {chain.chain_id} ended request {request_id!r} "
                                  f"before starting it")

        async def attach_and_take_the_first() -> tuple[AsyncIterator[GenerationStep],
                                                       GenerationStep]:
            stream = await self._open(decode_pb2.AttachRequest(
                request_id=request_id, wait_s=self.config.kv_wait_s, incarnation=me.incarnation))
            steps = self._steps(stream, route)
            try:
                return steps, await anext(steps)
            except BaseException:
                await steps.aclose()  # (a reader who leaves aborts the request)
                raise

        first = asyncio.ensure_future(attach_and_take_the_first())
        over = asyncio.ensure_future(until_the_call_ends(events))
        try:
            await asyncio.wait((first, over), return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and over.exception() is not None:
                raise over.exception()  # the chain broke before its push began
            return await first
        except BaseException:
            first.cancel()
            raise
        finally:
            over.cancel()
            call.cancel()  # the chain's part is over once the first token is here

    async def _open(self, request) -> RequestStream:
        """A Generate's or an Attach's stream on this pod, as its gRPC calls open them."""
        return await self.servicer.open_stream(self.servicer.worker, request)

    async def _steps(self, stream: RequestStream, route: Route) -> AsyncIterator[GenerationStep]:
        """The stream's steps (``DecodeServicer.steps``: a reader who leaves aborts it), the
        last with the route it took (a chain's partition from the push's header)."""
        async for step, _ in self.servicer.steps(self.servicer.worker, stream):
            if step.finish_reason is not None:
                step = dataclasses.replace(step, route=dataclasses.replace(
                    route, partition=step.route.partition if step.route else ()))
            yield step

    async def close(self) -> None:
        await self.channels.close()


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def open_door(config: DecodeServiceConfig, store: RoutingStore, servicer: DecodeServicer,
              describe: Callable[[], WorkerInfo], metrics: DecodeMetrics,
              ready: Callable[[], bool]) -> tuple[OpenAIServer, PodRouter]:
    """The pod's OpenAI door over its ``PodRouter`` (not started); its ``/metrics`` is the
    pod's registry, which the endpoint picker scrapes on the pool's target port."""
    model = ServedModel.load(config.model)
    router = PodRouter(config, model, store, servicer, describe, metrics)
    door = OpenAIServer(config.http, router, ApiKeys(config.auth.api_keys_file),
                        ChatTemplate.from_dir(model.directory), metrics.registry, ready=ready,
                        max_streams=config.server.max_streams,
                        max_body_bytes=config.server.max_message_mib << 20,
                        stall_s=config.gateway.stall_s)
    return door, router
