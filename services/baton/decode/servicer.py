"""The Decode gRPC service: convert, call the worker, convert back.

The handlers are coroutines on the server's event loop (``baton.serving.AsyncGrpcServer``):
a stream that waits for tokens, or an Attach that waits for its KV, holds no thread. Every
wait is bounded and ends when the caller cancels or its deadline passes (gRPC cancels the
handler); a caller that leaves aborts its request, which frees its KV. Every error a
handler meets becomes a gRPC status with a message that names the value
(``baton.api.convert.status_for`` plus the worker's own request errors); nothing a caller
sends can stop the server.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import AsyncIterator, Iterable

import grpc

from baton import tracing
from baton.api import convert
from baton.api.requests import GenerationStep
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.config import KVPoolConfig, MtlsConfig
from baton.decode.answers import failure_answer
from baton.decode.errors import RequestLeaving, RequestNotFound
from baton.decode.session import PodSession
from baton.decode.streams import RequestStream, StreamFailed
from baton.decode.worker import DecodeWorker
from baton.errors import PermissionDenied, Unavailable, check_incarnation
from baton.security.mtls import Mtls, require_role
from baton.transfer.codec import KVSpec
from baton.transfer.handoff import KVHandoff
from baton.transfer.receiver import (
    Incarnation,
    NixlPlane,
    PoolLanding,
    check_push,
    receive_body,
    receive_header,
)

DEFAULT_ATTACH_WAIT_S = 60.0  # an Attach that names no wait_s waits this long for the push
MAX_ATTACH_WAIT_S = 600.0  # and none waits longer
# A Generate for an id whose aborted stream is still leaving the engine (the gateway aborts
# a chain's push, then prefills the prompt here under the same id) waits this long for it.
LEAVING_WAIT_S = 5.0
# A push whose Attach is waiting reads its body only once the header's first token has been
# taken for the caller (or this long): the body would hold the event loop, and the caller
# waits for the token, while the KV is wanted only for the second token, a step later.
FIRST_TOKEN_LEAD_S = 0.005


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the error's status (raises, as ``context.abort`` does)."""
    await context.abort(*failure_answer(error))


def attach_wait_s(wait_s: float) -> float:
    """An Attach's wait: 0 (unset) is the default; NaN, infinite, negative or above the cap is
    refused with a message that names the value (INVALID_ARGUMENT)."""
    if wait_s == 0:
        return DEFAULT_ATTACH_WAIT_S
    if not (math.isfinite(wait_s) and 0 < wait_s <= MAX_ATTACH_WAIT_S):
        raise ValueError(f"wait_s must be a number of seconds in (0, {MAX_ATTACH_WAIT_S:g}] "
                         f"(0 = {DEFAULT_ATTACH_WAIT_S:g}), got {wait_s}")
    return wait_s


class Changes:
    """Wakes the coroutines waiting for a change in the worker's request table (an arrival, an
    abort, an end); ``notify`` may be called from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._event = asyncio.Event()

    def notify(self) -> None:
        if _running_loop() is self.loop:  # a handler's change: its waiters run next
            self._set()
        else:  # the engine thread's
            self.loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, timeout_s: float) -> None:
        """Until the next change or ``timeout_s``, whichever comes first."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            pass


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Serves one ``DecodeWorker``; UNAVAILABLE until ``ready(worker, spec, loop)`` and after
    ``drain()``."""

    def __init__(self, max_pending_pushes: int = KVPoolConfig.max_pending_pushes, mtls: Mtls | None = None,
                 stream_interval_s: float = 0.0, nixl: NixlPlane | None = None) -> None:
        """``nixl``: how pushed bytes are read over NIXL (None: pushes come over gRPC only)."""
        self.mtls = mtls or Mtls(MtlsConfig())
        self.nixl = nixl
        self.stream_interval_s = stream_interval_s  # see StreamConfig.interval_ms
        self.worker: DecodeWorker | None = None
        self.spec: KVSpec | None = None
        self.changes: Changes | None = None
        self.draining = False
        self.max_pending_pushes = max_pending_pushes
        self.pushes_in_progress = 0  # only the event loop changes it
        self.sessions: set[PodSession] = set()  # open Session calls (the event loop's)
        self._attaching: collections.Counter[str] = collections.Counter()  # request ids whose
        # Attach waits for its push to begin (the event loop's)

    @property
    def attaches_waiting(self) -> int:
        """Attach calls waiting for their push to begin."""
        return self._attaching.total()

    def ready(self, worker: DecodeWorker, spec: KVSpec, loop: asyncio.AbstractEventLoop,
              incarnation: Incarnation) -> None:
        """Serve ``worker``; ``loop`` is the server's event loop, where the worker's engine
        thread hands each step's streams (one hop per step, not one per token); work naming
        another ``incarnation`` is refused."""
        self.changes = Changes(loop)
        self.incarnation = incarnation

        def wake(streams: Iterable[RequestStream]) -> None:
            for stream in streams:
                stream.wake()

        worker.on_published = lambda streams: loop.call_soon_threadsafe(wake, streams)
        worker.on_change = self.changes.notify
        self.worker, self.spec = worker, spec

    def drain(self) -> None:
        """Refuse new work; sessions end once their open requests have (any thread)."""
        self.draining = True
        if self.changes is not None:
            for session in list(self.sessions):
                self.changes.loop.call_soon_threadsafe(session.wake)

    async def _worker(self, context: grpc.aio.ServicerContext, roles: tuple[str, ...],
                      what: str) -> DecodeWorker:
        """The worker, for a caller whose certificate names one of ``roles`` (PERMISSION_DENIED
        otherwise: a client of the gateway cannot push KV or attach to a request here)."""
        try:
            require_role(context, self.mtls, roles, what)
        except PermissionDenied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if self.worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode pod is still loading its model")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode pod is shutting down")
        return self.worker

    # --- RPCs ------------------------------------------------------------------------------

    async def PushKV(self, request_iterator: AsyncIterator[decode_pb2.PushKVRequest],
                     context) -> decode_pb2.PushKVResponse:
        worker = await self._worker(context, ("prefill",), "PushKV")
        if self.pushes_in_progress >= self.max_pending_pushes:
            worker.metrics.kv_pushes_rejected.labels(code="RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.pushes_in_progress} KV uploads are in progress on this pod, "
                                f"at most {self.max_pending_pushes}; retry or push elsewhere")
        self.pushes_in_progress += 1
        worker.metrics.kv_pushes_in_progress.set(self.pushes_in_progress)
        handoff = stream = landing = None
        span = tracing.start("baton.kv.receive", tracing.from_metadata(context.invocation_metadata()),
                             server=True)
        try:
            handoff = await receive_header(request_iterator)
            check_push(handoff, self.spec, worker.model_config, worker.engine.pool, self.incarnation)
            # The first token streams from here on, or from its own message if it follows.
            stream = worker.announce_push(handoff, tracing.traceparent(span))
            landing = PoolLanding(handoff.request_id, lambda: worker.land(handoff),
                                  worker.give_back)

            async def first_token_arrived(complete: KVHandoff) -> None:
                worker.publish_pushed_first(stream, complete)
                await self._let_it_leave(stream)

            if not handoff.first_token_follows:
                await self._let_it_leave(stream)
            cache = await receive_body(handoff, request_iterator, self.spec,
                                       model_config=worker.model_config,
                                       on_first_token=first_token_arrived, nixl=self.nixl,
                                       landing=landing)
            worker.submit_pushed(stream, cache)
            if cache.landed:
                landing = None  # the engine stores the cache in its landing's blocks
        except BaseException as e:
            tracing.end(span, error=e)
            if handoff is not None and handoff.request_id:  # and its request's stream's
                worker.push_failed(handoff.request_id, e, stream)
            if not isinstance(e, Exception):
                raise  # the call was cancelled (the chain went away)
            worker.metrics.kv_pushes_rejected.labels(code=convert.status_for(e).name).inc()
            await abort_with(context, e)
        finally:
            if landing is not None:
                landing.release()
            self.pushes_in_progress -= 1
            worker.metrics.kv_pushes_in_progress.set(self.pushes_in_progress)
        tracing.end(span, attributes={"baton.request_id": cache.request_id,
                                      "baton.kv.bytes": cache.num_bytes})
        return decode_pb2.PushKVResponse(request_id=cache.request_id,
                                         bytes_received=cache.num_bytes)

    async def _let_it_leave(self, stream: RequestStream) -> None:
        """When the request's Attach waits, until it has taken the pushed first token: the
        push's bytes would hold the event loop meanwhile (``FIRST_TOKEN_LEAD_S``)."""
        if self._attaching[stream.request_id]:
            await stream.first_taken(FIRST_TOKEN_LEAD_S)

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.GenerateResponse]:
        async for message in self._stream(request, context, "Generate"):
            yield message

    async def Attach(self, request, context) -> AsyncIterator[common_pb2.GenerateResponse]:
        async for message in self._stream(request, context, "Attach"):
            yield message

    async def _stream(self, request, context, method: str) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Generate and Attach: ``open_stream`` tells the two requests apart, the relay is one."""
        worker = await self._worker(context, ("gateway",), method)
        try:
            stream = await self.open_stream(worker, request)
        except Exception as e:  # noqa: BLE001
            await abort_with(context, e)
        async for message in self._relay(worker, stream, context):
            yield message

    async def Session(self, request_iterator, context) -> AsyncIterator[decode_pb2.SessionSteps]:
        worker = await self._worker(context, ("gateway",), "Session")
        session = PodSession(lambda request: self.open_stream(worker, request),
                             lambda stream: self.steps(worker, stream), lambda: self.draining)
        self.sessions.add(session)
        try:
            async for batch in session.run(request_iterator):
                yield batch
        finally:
            self.sessions.discard(session)

    async def Abort(self, request, context) -> common_pb2.AbortResponse:
        worker = await self._worker(context, ("gateway",), "Abort")
        if not worker.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} on this decode pod")
        return common_pb2.AbortResponse(found=True)

    async def Stats(self, request, context) -> common_pb2.WorkerLoad:
        worker = await self._worker(context, ("gateway", "prefill", "decode"), "Stats")
        return convert.worker_load_to_proto(worker.load)

    async def open_stream(self, worker: DecodeWorker, request) -> RequestStream:
        """The stream of a ``DecodeGenerateRequest`` (submitted here) or an ``AttachRequest``
        (its pushed KV awaited); raises what the request's call is to answer."""
        if self.draining:
            raise Unavailable("the decode pod is shutting down")
        if isinstance(request, decode_pb2.DecodeGenerateRequest):
            self._check_incarnation(f"request {request.request_id!r}", request.incarnation)
            return await self._submit(worker, convert.decode_request_from_proto(request))
        self._check_incarnation(f"the Attach of {request.request_id!r}", request.incarnation)
        return await self._attach(worker, request.request_id, attach_wait_s(request.wait_s))

    def _check_incarnation(self, what: str, theirs: str) -> None:
        check_incarnation(what, self.incarnation.address, self.incarnation.id, theirs)

    # --- waiting and streaming -----------------------------------------------------------------

    async def _submit(self, worker: DecodeWorker, request) -> RequestStream:
        """Submit a prompt; one whose id an aborted stream still holds waits for it to leave
        (``LEAVING_WAIT_S`` at most, then ALREADY_EXISTS as for any live id)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LEAVING_WAIT_S
        while True:
            try:
                return worker.submit_prompt(request)
            except RequestLeaving:
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    raise
                await self.changes.wait(remaining_s)

    async def _attach(self, worker: DecodeWorker, request_id: str, wait_s: float) -> RequestStream:
        """The pushed request's stream, waiting up to ``wait_s`` for its cache to arrive (a
        caller that leaves first cancels this wait)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self._attaching[request_id] += 1
        try:
            while (stream := worker.try_attach(request_id)) is None:
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    raise RequestNotFound(f"no request {request_id!r} on this decode pod (waited "
                                          f"{wait_s:.3g} s for its KV)")
                await self.changes.wait(remaining_s)
        finally:
            self._attaching[request_id] -= 1
            if not self._attaching[request_id]:
                del self._attaching[request_id]
        return stream

    async def _relay(self, worker: DecodeWorker, stream: RequestStream,
                     context) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Yield the request's steps until its last; a failure ends the call with its status."""
        try:
            async for step, first in self.steps(worker, stream):
                yield convert.step_to_proto(step, first)
        except StreamFailed as e:
            await abort_with(context, e)

    async def steps(self, worker: DecodeWorker,
                    stream: RequestStream) -> AsyncIterator[tuple[GenerationStep, bool]]:
        """The request's steps until its last (what arrived together goes as one message),
        each with whether it is the first; raises StreamFailed. A reader who leaves early
        (the handler is cancelled, or the generator closed) aborts the request."""
        finished, first = False, True
        loop = asyncio.get_running_loop()
        sent_at = 0.0
        try:
            while not finished:
                # the first message goes at once; the next ones stream_interval_s apart
                step = await stream.next_steps(0.0 if first else sent_at + self.stream_interval_s)
                finished = step.finish_reason is not None
                sent_at = loop.time()
                yield step, first
                first = False
        except StreamFailed:
            finished = True  # the worker dropped it already
            raise
        finally:
            if not finished:
                worker.cancel(stream.request_id)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
