"""The Decode gRPC service: convert, call the worker, convert back.

Every error a handler meets becomes a gRPC status with a message that names the value
(``baton.api.convert.status_for`` plus the worker's own request errors); nothing a caller
sends can stop the server. Streams (Generate, Attach) poll their request's queue so that a
caller who went away is noticed, and a cancelled or dropped call aborts its request, which
frees its KV.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import grpc

from baton.api import convert
from baton.api.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from baton.decode.receiver import receive_cache
from baton.decode.streams import RequestStream, StreamFailed
from baton.decode.worker import DecodeWorker, RequestAborted, RequestExists, RequestNotFound
from baton.kv.wire import KVSpec

log = logging.getLogger(__name__)

DEFAULT_ATTACH_WAIT_S = 60.0  # an Attach that names no wait_s waits this long for the push
MAX_ATTACH_WAIT_S = 600.0  # and none waits longer
STREAM_POLL_S = 0.5  # how often a waiting stream checks that its caller is still there

_WORKER_ERRORS = [(RequestExists, grpc.StatusCode.ALREADY_EXISTS),
                  (RequestNotFound, grpc.StatusCode.NOT_FOUND),
                  (RequestAborted, grpc.StatusCode.ABORTED),
                  (StreamFailed, grpc.StatusCode.INTERNAL)]


def status_of(error: BaseException) -> grpc.StatusCode:
    for error_type, code in _WORKER_ERRORS:
        if isinstance(error, error_type):
            return code
    return convert.status_for(error)


def abort_with(context: grpc.ServicerContext, error: BaseException) -> None:
    """End the call with the error's status (raises, as ``context.abort`` does)."""
    code = status_of(error)
    if code is grpc.StatusCode.INTERNAL and not isinstance(error, StreamFailed):
        log.error("internal error in a decode call", exc_info=error)
    context.abort(code, str(error) or type(error).__name__)


def attach_wait_s(wait_s: float) -> float:
    """An Attach's wait: 0 (unset) is the default; NaN, infinite, negative or above the cap is
    refused with a message that names the value (INVALID_ARGUMENT)."""
    if wait_s == 0:
        return DEFAULT_ATTACH_WAIT_S
    if not (math.isfinite(wait_s) and 0 < wait_s <= MAX_ATTACH_WAIT_S):
        raise ValueError(f"wait_s must be a number of seconds in (0, {MAX_ATTACH_WAIT_S:g}] "
                         f"(0 = {DEFAULT_ATTACH_WAIT_S:g}), got {wait_s}")
    return wait_s


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Serves one ``DecodeWorker``; UNAVAILABLE until ``ready(worker, spec)`` and after ``drain()``."""

    def __init__(self) -> None:
        self.worker: DecodeWorker | None = None
        self.spec: KVSpec | None = None
        self.draining = False

    def ready(self, worker: DecodeWorker, spec: KVSpec) -> None:
        self.worker, self.spec = worker, spec

    def drain(self) -> None:
        self.draining = True

    def _worker(self, context: grpc.ServicerContext) -> DecodeWorker:
        if self.worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the decode pod is still loading its model")
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the decode pod is shutting down")
        return self.worker

    # --- RPCs ------------------------------------------------------------------------------

    def PushKV(self, request_iterator, context) -> decode_pb2.PushKVResponse:
        worker = self._worker(context)
        try:
            cache = receive_cache(request_iterator, self.spec, worker.model_config,
                                  worker.engine.pool)
            worker.submit_pushed(cache)
        except Exception as e:  # noqa: BLE001 - every failure becomes the caller's status
            worker.metrics.kv_pushes_rejected.labels(code=status_of(e).name).inc()
            abort_with(context, e)
        return decode_pb2.PushKVResponse(request_id=cache.request_id,
                                         bytes_received=cache.num_bytes)

    def Generate(self, request, context) -> Iterator[common_pb2.GenerateResponse]:
        worker = self._worker(context)
        try:
            stream = worker.submit_prompt(convert.decode_request_from_proto(request))
        except Exception as e:  # noqa: BLE001
            abort_with(context, e)
        yield from self._relay(worker, stream, context)

    def Attach(self, request, context) -> Iterator[common_pb2.GenerateResponse]:
        worker = self._worker(context)
        try:
            stream = worker.attach(request.request_id, attach_wait_s(request.wait_s),
                                   caller_active=context.is_active)
        except Exception as e:  # noqa: BLE001
            abort_with(context, e)
        yield from self._relay(worker, stream, context)

    def Abort(self, request, context) -> common_pb2.AbortResponse:
        worker = self._worker(context)
        if not worker.abort(request.request_id):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no request {request.request_id!r} on this decode pod")
        return common_pb2.AbortResponse(found=True)

    def Stats(self, request, context) -> common_pb2.WorkerLoad:
        return convert.worker_load_to_proto(self._worker(context).load)

    # --- streaming -------------------------------------------------------------------------

    @staticmethod
    def _relay(worker: DecodeWorker, stream: RequestStream,
               context: grpc.ServicerContext) -> Iterator[common_pb2.GenerateResponse]:
        """Yield the request's steps until its last; a caller who leaves aborts it."""
        context.add_callback(lambda: worker.cancel(stream.request_id))
        while True:
            try:
                step = stream.next_step(STREAM_POLL_S)
            except StreamFailed as e:
                abort_with(context, e)
            if step is None:
                if not context.is_active():
                    worker.cancel(stream.request_id)
                    return
                continue
            yield convert.step_to_proto(step)
            if step.finish_reason is not None:
                return
