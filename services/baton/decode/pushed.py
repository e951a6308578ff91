"""The decode pod's side of pushed requests (``DecodeWorker``'s part for them): a chain's
push announces its request (``announce_push``: the stream opens, with the chain's first token
unless that follows, ``publish_pushed_first``), may land its cache in the pool as it arrives
(``land``, ``give_back``), hands the checked cache to the engine (``submit_pushed``) or
fails (``push_failed``: the stream fails, or, refused before it opened one, the Attach that
waits for it is told why). The caller claims the stream with ``try_attach``, usually before
the push begins. Everything here runs on the server's handler threads, under the worker's
lock where it touches the request table.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys
import time

from baton.api import convert
from baton.api.requests import Route
from baton.decode.errors import PushFailed, RequestAborted, RequestExists
from baton.decode.streams import PushedKVInfo, PushLost, RequestStream
from baton.dtypes import DTYPES
from baton.model.tokenizer import IncrementalDecoder
from baton.transfer.device_copy import to_device
from baton.transfer.handoff import KVHandoff
from baton.transfer.receiver import PushedCache


class PushedRequests:
    def announce_push(self, handoff: KVHandoff, traceparent: str = "") -> RequestStream:
        """A checked push header: the request's stream opens, with the chain's first token
        unless that follows (``publish_pushed_first``); the KV follows. ``traceparent``: the
        push's span on this pod (its request's spans go under it)."""
        full = len(handoff.prompt_token_ids) * len(handoff.kv.layer_num_tokens)
        kept = sum(handoff.kv.layer_num_tokens)
        stream = RequestStream(handoff.request_id, len(handoff.prompt_token_ids),
                               Route(self.address),
                               PushedKVInfo(handoff.kv.total_bytes, kept, full), in_engine=False,
                               traceparent=traceparent)
        with self._lock:
            if handoff.request_id in self._aborted_early:
                raise RequestAborted(f"request {handoff.request_id!r} was aborted before its KV "
                                     f"arrived")
            self._claim(stream)
            self._failed_pushes.pop(handoff.request_id)  # an earlier push's failure
            self._leases.awaiting[handoff.request_id] = stream
        if not handoff.first_token_follows:
            self.publish_pushed_first(stream, handoff)
        return stream

    def land(self, handoff: KVHandoff) -> concurrent.futures.Future | None:
        """Ask the engine for the pool's blocks of a pushed cache whose header checked out, so
        that its keys and values are copied straight into them as they arrive
        (``baton.transfer.received``); None where the pool cannot take its bytes as they are (a
        device pool, another dtype or byte order). A push that asked and does not hand its
        cache over landed gives the blocks back: ``give_back``."""
        kv = handoff.kv
        if kv.byte_order != sys.byteorder or not self.engine.pool.takes_bytes(
                DTYPES[kv.dtype], kv.num_kv_heads, kv.head_dim):
            return None
        return self.engine.land(kv.layer_num_tokens)

    def give_back(self, landing: concurrent.futures.Future) -> None:
        """The blocks of a landing (``land``) whose push does not hand its cache over landed
        go back to the pool, once the engine has claimed them."""

        def drop(claimed: concurrent.futures.Future) -> None:
            if not claimed.cancelled() and claimed.exception() is None:
                self.engine.drop_landed(claimed.result())

        landing.add_done_callback(drop)

    def publish_pushed_first(self, stream: RequestStream, handoff: KVHandoff) -> None:
        """The chain's first token (``handoff``'s, complete) streams now, with its text unless
        stop strings decide what is released."""
        text = ""
        if not handoff.sampling.stop and self.engine.tokenizer is not None:
            text = IncrementalDecoder(self.engine.tokenizer).push(handoff.first_token_id)
        stream.pushed.prefill_s, stream.pushed.partition = handoff.prefill_s, handoff.partition
        with self._lock:
            if self._streams.get(handoff.request_id) is not stream or stream.finished:
                return  # aborted or failed since its header: its stream says so already
            stream.publish_first(handoff.first_token_id, text, time.monotonic(),
                                 handoff.first_token_logprobs)
        self.metrics.vllm.generation_tokens.inc()  # the chain's tail sampled it; it streams here
        self.on_published([stream])

    def submit_pushed(self, stream: RequestStream, cache: PushedCache) -> None:
        """The checked cache of the push that announced ``stream`` joins the running set."""
        handoff = cache.handoff
        with self._lock:
            if self._streams.get(handoff.request_id) is not stream or stream.in_engine:
                # aborted, cancelled or failed since its header (its id may be another push's now)
                raise RequestAborted(f"request {handoff.request_id!r} ended before its KV arrived")
            stream.in_engine = True
            stream.pushed.push_s = time.monotonic() - stream.arrival_s
        params = dataclasses.replace(handoff.sampling, compression=handoff.compression)
        layers = cache.layers
        device = self.engine.model.device
        if device.type == "cuda" and not cache.landed:
            # through pinned memory on the copy stream, starting now: the engine steps on, and
            # the copy is (most likely) done by the time the request is admitted
            layers = to_device(layers, device)
        try:
            self.engine.add_prefilled_request(list(handoff.prompt_token_ids), layers,
                                              handoff.first_token_id, params, handoff.request_id,
                                              handoff.cache_salt, handoff.first_token_logprobs)
        except Exception:
            with self._lock:
                stream.in_engine = False  # push_failed fails its stream
            raise
        self.metrics.kv_bytes_received.labels(transport=cache.transport).inc(cache.num_bytes)
        if cache.landed:
            self.metrics.kv_pushes_landed.inc()
        self.metrics.compression_ratio.observe(stream.pushed.kv_tokens_kept / stream.pushed.kv_tokens_full)

    def push_failed(self, request_id: str, error: BaseException,
                    announced: RequestStream | None = None) -> None:
        """A push for ``request_id`` failed after its header was read: the stream it
        ``announced`` (if still open) fails, or the Attach that waits for it will."""
        code = convert.status_for(error).name
        message = f"the chain's push of request {request_id!r} failed: {code}: {error}"
        record = False  # for an Attach still to come
        with self._lock:
            stream = self._streams.get(request_id)
            if announced is None:  # refused before its stream opened
                record = stream is None and request_id not in self._aborted_early
                stream = None
            elif stream is not announced or stream.in_engine:
                stream = None  # ended, replaced by a newer push, or in the engine (its own end)
            else:
                del self._streams[request_id]
                self._leases.awaiting.pop(request_id, None)
                record = not stream.attached
            if record:
                self._failed_pushes.add(request_id, message)
        if stream is not None:
            stream.fail(message, PushLost)
            self.on_published([stream])
        self.on_change()

    def try_attach(self, request_id: str) -> RequestStream | None:
        """The stream of a pushed request, None while its cache has not arrived; a finished
        one that nobody claimed yet is still there (its steps kept for ``lease_s``)."""
        with self._lock:
            if request_id in self._aborted_early:
                raise RequestAborted(f"request {request_id!r} was aborted")
            failed = self._failed_pushes.pop(request_id)
            if failed is not None:
                raise PushFailed(failed)
            unclaimed = self._leases.claim_unclaimed(request_id)
            if unclaimed is not None:
                return unclaimed
            stream = self._streams.get(request_id)
            if stream is None:
                return None
            if stream.leaving:  # an earlier attempt's, on its way out: wait for the next push
                return None
            if stream.attached:
                raise RequestExists(f"request {request_id!r} is already being streamed")
            stream.attached = True
            self._leases.awaiting.pop(request_id, None)
            return stream
