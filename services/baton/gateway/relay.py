"""One request's trip through the pods the policy picked, as the client's stream of steps.

Tokens come from one place, the decode pod the policy chose, on either path
(docs/architecture.md, "A request's path"):

* local: a Generate on the decode pod, relayed as it streams;
* chain: ``Prefill.Prefill`` queues the prompt on the chain's rank 0 and an Attach on the
  decode pod opens the request's stream at the same time; the chain's tail pushes the first
  token with the KV to that pod, which streams the token as soon as the push's header
  arrives (TTFT is the chain's plus one hop), then the rest. The Prefill call carries no
  token: it says when the chain starts the request and fails if the chain breaks first,
  which is how the gateway learns that no KV will come.

Generate and Attach go over the gateway's session with the pod (``Decode.Session``, one
call per pod carrying every request, ``baton.gateway.decode_session``).

When a pod fails the request (docs/architecture.md, "When a pod dies"), the client's stream
goes on. A chain that fails it before its first token (a rank died, the push was refused
or lost) hands an automatic request to a decode pod that prefills it itself
(``chain_failure: recompute``); a request pinned to the chain waits for a live chain (one
restarted, or another) and goes through it again. A decode pod that fails mid-stream (the
chain's push lost half way included) is replaced by another live one, found by the
servicer's ``reroute``, which gets the prompt plus every token already sent and generates
the rest (``migration_limit`` times at most). Greedy and seeded requests continue token for
token as if nothing happened (the new pod samples at the position where the old one
stopped); the usage on the last step counts the whole request.

The relay fills in what only it knows on the last step: the route's chain and reason; the
chain's figures (bytes shipped, prefill and push time, partition) come from the decode pod,
which had them on the push's header. Errors are downstream ``grpc.RpcError``s; the servicer
turns them into the client's status. Every downstream call is registered on the
``LiveRequest`` so a cancellation reaches it. Everything here runs on the gateway's event
loop (``grpc.aio`` channels, one per pod, shared by every request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from baton import tracing
from baton.api import convert
from baton.api.requests import (
    DecodeRequest,
    FinishReason,
    GenerateRequest,
    GenerationStep,
    PrefillRequest,
    Route,
    Usage,
    tenant_salt,
)
from baton.api.v1 import common_pb2, decode_pb2
from baton.config import KV_TRANSPORTS, GatewayRoutingConfig
from baton.errors import Unavailable
from baton.gateway.channels import Channels
from baton.gateway.request_table import LiveRequest
from baton.gateway.routing_policy import RouteDecision
from baton.metrics import GatewayMetrics
from baton.routing import RequestRecord, WorkerInfo

ABORT_TIMEOUT_S = 5.0  # an Abort to a pod that does not answer in this long is given up
# What a failed pod (or a failed chain) answers, as opposed to what the request itself
# caused (INVALID_ARGUMENT, ...) or the caller did (CANCELLED, ABORTED): worth another pod.
POD_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                          grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                          grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED,
                          grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.FAILED_PRECONDITION})  # incl. a pod restarted on its address

Reroute = Callable[[int, frozenset[str]], Awaitable[WorkerInfo]]
# A live chain (and its decode pod) for a pinned request whose chain failed it, none whose
# incarnation is in the set; raises when none came in time.
RerouteChain = Callable[[int, frozenset[str]], Awaitable[RouteDecision]]


log = logging.getLogger(__name__)


class ChainIncomplete(Unavailable, RuntimeError):
    """The decode pod ended a chain request's stream before its first token (UNAVAILABLE)."""


class Relay:
    def __init__(self, channels: Channels, model_id: str,
                 config: GatewayRoutingConfig, metrics: GatewayMetrics) -> None:
        self.channels = channels
        self.model_id = model_id
        self.config = config
        self.metrics = metrics

    async def stream(self, live: LiveRequest, request: GenerateRequest,
                     prompt_ids: tuple[int, ...], decision: RouteDecision,
                     reroute: Reroute, reroute_chain: RerouteChain) -> AsyncIterator[GenerationStep]:
        """The client's steps, whichever pods end up producing them."""
        sent: list[int] = []  # generated token ids the client already has
        decode = decision.decode
        reason = decision.reason  # grows by what happened on the way (on the last step's route)
        moves = 0
        while decision.chain is not None:
            try:
                async for step in self._chain(live, prompt_ids, request, decision):
                    sent += step.token_ids
                    yield step
                return
            except (grpc.RpcError, ChainIncomplete) as e:
                live.chain_done = True
                code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                if sent:  # past the first token: the decode pod failed it (or lost the push)
                    failed = decode
                    decode = await self._move(live, prompt_ids, sent, reroute, decode, e, moves)
                    reason += _moved(failed, decode, e, len(sent))
                    moves += 1
                    break
                # A chain refuses a decode pod the routing store no longer lists (it died
                # after this gateway last read the store): prefill elsewhere, not there.
                stale_pod = code == grpc.StatusCode.PERMISSION_DENIED and not live.aborted.is_set()
                if not (self._recoverable(live, code) or stale_pod):
                    raise
                self.metrics.chain_fallbacks.labels(code=code.name).inc()
                failed_chain = decision.chain
                if stale_pod and request.prefill_route == "chain":
                    raise
                if request.prefill_route == "chain" and moves < self.config.migration_limit:
                    log.warning("request %s: chain %s failed it (%s); waiting for a live chain",
                                live.request_id, failed_chain.chain_id, _describe(e))
                    decision = await self._next_chain(live, prompt_ids, reroute_chain,
                                                      failed_chain, e)
                    decode = decision.decode
                    reason += (f"; chain {failed_chain.chain_id} failed it ({code.name}): "
                               f"sent to chain {decision.chain.chain_id} again")
                    moves += 1
                    continue
                if self.config.chain_failure != "recompute" or request.prefill_route == "chain":
                    raise
                log.warning("request %s: chain %s failed it (%s); prefilling it on a decode "
                            "pod", live.request_id, failed_chain.chain_id, _describe(e))
                # The chain failed it, not the decode pod: any live pod may take it (one that
                # died meanwhile fails the Generate, and the request moves on from there).
                unlisted = frozenset({decode.address}) if stale_pod else frozenset()
                decode = await self._next_pod(live, prompt_ids, sent, reroute, unlisted, e)
                reason += (f"; chain {failed_chain.chain_id} failed it ({code.name}): "
                           f"prefilled on the decode pod")
                # The chain may still push the KV: the decode pod must refuse it before the
                # id is used again (its Generate waits for an aborted stream to leave).
                await self._abort_on(decode.address, live.record.pod_request_id)
                break
        while True:
            try:
                async for step in self._local(live, request, prompt_ids, sent, decode, reason):
                    sent += step.token_ids
                    yield step
                return
            except grpc.RpcError as e:
                failed = decode
                decode = await self._move(live, prompt_ids, sent, reroute, decode, e, moves)
                reason += _moved(failed, decode, e, len(sent))
                moves += 1

    async def _next_chain(self, live: LiveRequest, prompt_ids: tuple[int, ...],
                          reroute_chain: RerouteChain, failed: WorkerInfo,
                          error: Exception) -> RouteDecision:
        """A live chain for a pinned request its chain failed: not the failed incarnation
        (a restarted chain registers anew); raises ``error`` when none came in time."""
        try:
            decision = await reroute_chain(len(prompt_ids), frozenset({failed.incarnation}))
        except Exception as e:  # none came: the request fails with its own cause
            raise error from e
        # The failed attempt's decode pod may still hold its id (its Attach's cancel is on
        # the way, or the push's header opened a stream): the next attempt gets an id of its
        # own, and what the last one left there is aborted.
        await self._abort_on(live.record.decode_address, live.record.pod_request_id)
        live.chain_done = False
        await _relocate(live, decode_address=decision.decode.address,
                        chain_id=decision.chain.chain_id, prefill_address=decision.chain.address,
                        attempt=live.record.attempt + 1)
        return decision

    async def _abort_on(self, address: str, request_id: str) -> None:
        """Abort whatever the decode pod at ``address`` holds under ``request_id`` (nothing,
        usually); a pod that does not answer is left to fail the request's next call."""
        try:
            await self.channels.decode(address).Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError:
            pass

    def _recoverable(self, live: LiveRequest, code: grpc.StatusCode) -> bool:
        return not live.aborted.is_set() and code in POD_FAILURES

    async def _move(self, live: LiveRequest, prompt_ids: tuple[int, ...], sent: list[int],
                    reroute: Reroute, failed: WorkerInfo, error: grpc.RpcError,
                    moves: int) -> WorkerInfo:
        """The pod for the rest of a stream whose decode pod failed it; re-raises ``error``
        when the request may not move (again)."""
        if not self._recoverable(live, error.code()) or moves >= self.config.migration_limit:
            raise error
        self.metrics.migrations.labels(code=error.code().name).inc()
        log.warning("request %s: decode pod %s failed after %d tokens (%s); moving it (%d of %d)",
                    live.request_id, failed.address, len(sent), _describe(error), moves + 1,
                    self.config.migration_limit)
        began = time.monotonic()
        decode = await self._next_pod(live, prompt_ids, sent, reroute,
                                      _failed_pod(failed, error.code()), error)
        if live.traceparent:
            tracing.record("baton.gateway.migrate", live.traceparent, began, time.monotonic(),
                           {"baton.migration.from": failed.address, "baton.migration.to": decode.address,
                            "baton.migration.code": error.code().name,
                            "baton.migration.tokens_sent": len(sent), "baton.migration.number": moves + 1})
        return decode

    async def _next_pod(self, live: LiveRequest, prompt_ids: tuple[int, ...], sent: list[int],
                        reroute: Reroute, exclude: frozenset[str], error: Exception) -> WorkerInfo:
        """A live decode pod for the rest of the request, none in ``exclude`` (addresses or
        incarnations); raises ``error`` when none came."""
        try:
            decode = await reroute(len(prompt_ids) + len(sent), exclude)
        except Exception as e:  # none came: the request fails with its own cause
            raise error from e
        await _relocate(live, decode_address=decode.address)
        return decode

    async def _local(self, live: LiveRequest, request: GenerateRequest, prompt_ids: tuple[int, ...],
                     sent: list[int], decode: WorkerInfo, reason: str) -> AsyncIterator[GenerationStep]:
        """Generate on ``decode``; after a failure elsewhere, ``sent`` are the tokens the client
        has: they are replayed as prompt and only the rest is generated."""
        route = Route(decode_address=decode.address, reason=reason)
        remaining = request.sampling.max_tokens - len(sent)
        if remaining <= 0:  # the failure came after the last token: only the end is missing
            yield GenerationStep(live.request_id, finish_reason=FinishReason.LENGTH, route=route,
                                 usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(sent)))
            return
        sampling = request.sampling
        if sent:  # the client has the prompt's log probabilities already, if it asked
            sampling = dataclasses.replace(sampling, max_tokens=remaining, prompt_logprobs=None)
        decode_request = DecodeRequest(request_id=live.record.pod_request_id,
                                       prompt_token_ids=prompt_ids + tuple(sent),
                                       sampling=sampling, compression=request.compression,
                                       generated_before=len(sent), incarnation=decode.incarnation,
                                       cache_salt=tenant_salt(live.record.owner, request.cache_salt),
                                       traceparent=live.traceparent)
        call = self.channels.session(decode.address).generate(
            convert.decode_request_to_proto(decode_request))
        live.watch(call)
        replayed = len(sent)
        async for message in call:
            step = convert.step_from_proto(message)
            if step.finish_reason:
                step = dataclasses.replace(step, route=route)
                if replayed and step.usage is not None:  # count the request, not this pod's part
                    step = dataclasses.replace(step, usage=dataclasses.replace(
                        step.usage, prompt_tokens=len(prompt_ids),
                        completion_tokens=step.usage.completion_tokens + replayed))
            yield step

    async def _chain(self, live: LiveRequest, prompt_ids: tuple[int, ...],
                     request: GenerateRequest, decision: RouteDecision
                     ) -> AsyncIterator[GenerationStep]:
        """A chain request: the prompt queued on the chain, its stream opened on the decode
        pod once the chain has taken it (its compute hides the opening, which would otherwise
        compete with the prompt's way to the chain). Raises before the first step when the
        chain fails it (its Prefill call fails, or the decode pod refused or lost the push)."""
        prefill_request = PrefillRequest(
            request_id=live.record.pod_request_id, model=self.model_id, prompt_token_ids=prompt_ids,
            sampling=request.sampling, compression=request.compression,
            decode_address=decision.decode.address, decode_incarnation=decision.decode.incarnation,
            cache_salt=tenant_salt(live.record.owner, request.cache_salt),
            # (a transport this release does not know, a newer pod's, is not used)
            decode_kv_transport=(decision.decode.kv_transport
                                 if decision.decode.kv_transport in KV_TRANSPORTS else "grpc"),
            traceparent=live.traceparent)
        prefill = self.channels.prefill(decision.chain.address).Prefill(
            convert.prefill_request_to_proto(prefill_request))
        live.watch(prefill)
        events = aiter(prefill)
        first = chain = None
        try:
            if await chain_event(events) is None:
                raise ChainIncomplete(f"chain {decision.chain.chain_id} ended request "
                                      f"{live.request_id!r} before starting it")
            attach = self.channels.session(decision.decode.address).attach(
                decode_pb2.AttachRequest(request_id=live.record.pod_request_id,
                                         wait_s=self.config.kv_wait_s,
                                         incarnation=decision.decode.incarnation))
            live.watch(attach)
            steps = aiter(attach)
            first = asyncio.ensure_future(anext(steps, None))
            chain = asyncio.ensure_future(until_the_call_ends(events))
            await asyncio.wait((first, chain), return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and chain.exception() is not None:
                attach.cancel()
                raise chain.exception()  # the chain broke before its push began
            message = await first
        except BaseException:
            for task in (first, chain):
                if task is not None:
                    task.cancel()
            prefill.cancel()
            raise
        live.chain_done = True
        try:
            if message is None:
                raise ChainIncomplete(f"decode pod {decision.decode.address} ended request "
                                      f"{live.request_id!r} before its first token")
            route = Route(decode_address=decision.decode.address, chain_id=decision.chain.chain_id,
                          reason=decision.reason)
            first_step = True
            while message is not None:
                step = convert.step_from_proto(message)
                if step.finish_reason:
                    partition = step.route.partition if step.route else ()
                    step = dataclasses.replace(step, route=dataclasses.replace(route, partition=partition))
                yield step
                if first_step:  # the chain's part is over: its call goes, after the token has
                    first_step = False
                    chain.cancel()
                    prefill.cancel()
                message = await anext(steps, None)
        finally:
            chain.cancel()
            prefill.cancel()

    async def abort_pods(self, record: RequestRecord) -> bool:
        """Abort a request on every pod that may hold state for it (the chain first, so it
        pushes nothing more, then the decode pod); True when any pod held some. A pod that
        cannot be reached holds nothing that outlives it (its state dies with it or by TTL)."""
        stubs = [self.channels.decode(record.decode_address)]
        if record.prefill_address:
            stubs.insert(0, self.channels.prefill(record.prefill_address))
        found = False
        for stub in stubs:
            try:
                answer = await stub.Abort(common_pb2.AbortRequest(request_id=record.pod_request_id),
                                          timeout=ABORT_TIMEOUT_S)
            except grpc.RpcError:
                continue
            found = found or answer.found
        return found


async def _relocate(live: LiveRequest, **changes) -> None:
    """The request lives elsewhere now: its record says so, here and in the store."""
    live.record = dataclasses.replace(live.record, **changes)
    await asyncio.get_running_loop().run_in_executor(None, live.rewrite, live.record)


def _failed_pod(failed: WorkerInfo, code: grpc.StatusCode) -> frozenset[str]:
    """What a request that ``failed`` answered with ``code`` must not be sent to again: the
    failed pod only when it still answers (an unreachable address is left out, and so is an
    incarnation that refused the work: its routing record is older than the process now on
    that address)."""
    if code is grpc.StatusCode.UNAVAILABLE:
        return frozenset({failed.address})
    if code is grpc.StatusCode.FAILED_PRECONDITION and failed.incarnation:
        return frozenset({failed.incarnation})
    return frozenset()


def _moved(failed: WorkerInfo, decode: WorkerInfo, error: grpc.RpcError, num_sent: int) -> str:
    return (f"; decode pod {failed.address} failed after {num_sent} tokens "
            f"({error.code().name}): moved to {decode.address}")


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error)


async def chain_event(events):
    """The Prefill call's next message, None at its end (its one message says the chain
    started the request; its failure, that the chain broke first). The relay cancels this
    read before it cancels the call, so a CANCELLED call here was cancelled by rank 0's
    server as it went down."""
    try:
        return await anext(events, None)
    except grpc.aio.AioRpcError as e:
        if e.code() is not grpc.StatusCode.CANCELLED:
            raise
        raise ChainIncomplete(f"the chain's rank 0 ended the call as it stopped: {e.details()}") from e


async def until_the_call_ends(events) -> None:
    """Read the rest of a Prefill call (``chain_event``)."""
    while await chain_event(events) is not None:
        pass
