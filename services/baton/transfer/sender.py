"""The sending side of a push: one request's cache on its way from a chain's tail to a decode
pod (Decode.PushKV), by layer as the chain finishes each or all at once after it, over gRPC
or with the bytes left for the pod's NIXL read. What a layer becomes before it goes (the
request's compression) and the first token are the tail's (``baton.prefill.tail``).
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Callable

import grpc

from baton import tracing
from baton.api.requests import PrefillRequest
from baton.kv.dense import LayerKV
from baton.kv.storage import KVStorage
from baton.security.mtls import Mtls
from baton.serving import CHANNEL_OPTIONS
from baton.transfer import framing
from baton.transfer.codec import KVHeader, KVMalformed, encode_kv, layer_segments
from baton.transfer.device_copy import HostCopy, layers_to_host, to_host
from baton.transfer.handoff import FirstToken, KVHandoff
from baton.transfer.nixl import NIXL, NixlAgent, NixlSource

PUSH_TIMEOUT_S = 120.0  # one cache over gRPC: even a large one takes seconds


class Shipment:
    """One request's KV on its way to the decode pod, over its open ``PushCall``.

    By layer (``begin_by_layer``): the header at once, each layer as the chain finishes it
    (prepared first: compressed when the request compresses), then, once the logits exist, the first
    token, the last layer and the trailer. Otherwise (``finish`` alone): the header with the
    first token, then the whole cache. With a NIXL ``source``, where each layer's (or the
    cache's) bytes lie goes in place of the bytes, which stay registered until the pod has
    answered (or the push is cancelled). A failure while layers go out (the pod refused the
    header, a layer is not what the header announced) never reaches the chain: the push is
    cancelled, and ``finish`` raises what happened."""

    def __init__(self, details: bytes, request: PrefillRequest, push: PushCall,
                 storage: KVStorage,
                 prepare: Callable[[int, LayerKV], LayerKV] | None, model_id: str, revision: str,
                 source: NixlSource | None = None,
                 shipper: concurrent.futures.Executor | None = None, span=None) -> None:
        """``storage``: what keys and values go out as (the decode pod's pool's: fp8 and its
        scale, or the compute dtype); every layer is stored so after it is prepared.
        ``prepare``: what becomes of a finished layer before it goes out (the request's
        compression; None: it goes as it is). ``shipper``: one thread that sends layers copied
        off a GPU, in order (None: every layer is sent by the caller). ``span``: the push's
        trace span (None: untraced), ended with it."""
        self.details = details
        self.span = span
        self._shipper = shipper
        self._queued: concurrent.futures.Future | None = None  # the last layer given to it
        self.source = source
        self.model_id, self.revision = model_id, revision
        self.request = request
        self.push = push
        self.prepare = prepare
        self.storage = storage
        self.num_bytes = 0
        self._writer: framing.LayerByLayer | None = None
        self._header: KVHeader | None = None
        self._failure: Exception | None = None

    def begin_by_layer(self, header: KVHeader) -> None:
        request = self.request
        self._header = header
        handoff = KVHandoff(header, request.prompt_token_ids, 0, request.sampling,
                            request.compression, request.decode_incarnation, request.cache_salt,
                            first_token_follows=True)
        self._writer = framing.LayerByLayer(handoff, self.push.put, self.source)

    def ship_layer(self, index: int, layer: LayerKV) -> None:
        """Called by the chain's compute: a layer on a GPU only starts its copy to the host
        here; the shipper thread sends it once it is there, while the chain computes on."""
        if self._writer is None or self._failure is not None:
            return
        try:
            layer = self._checked(index, layer)
            if self._shipper is not None:
                copy = to_host([layer.positions, layer.k, layer.v])
                self._queued = self._shipper.submit(self._send_copied, copy)
            else:
                self._send(layer)
        except Exception as e:  # noqa: BLE001 - kept for finish(); the chain computes on
            self._fail(e)

    def _send_copied(self, copy: HostCopy) -> None:
        """On the shipper thread: a layer's copy to the host, sent once it is done."""
        if self._failure is not None:
            return
        try:
            positions, k, v = copy.wait()
            self._send(LayerKV(k, v, positions))
        except Exception as e:  # noqa: BLE001 - kept for finish()
            self._fail(e)

    def _fail(self, error: Exception) -> None:
        self._failure = error
        self.push.cancel()

    def finish(self, first: FirstToken, layers: list[LayerKV]) -> None:
        """Send what is left of the cache ``layers`` (everything, unless by layer) with the
        first token, and wait for the pod's answer."""
        try:
            self._finish(first, layers)
        except Exception as e:
            self._end_span(e)
            raise
        else:
            self._end_span()
        finally:
            if self.source is not None:
                self.source.release()

    def _finish(self, first: FirstToken, layers: list[LayerKV]) -> None:
        if self._queued is not None:
            self._queued.result()  # the shipper has sent every layer before the last
        if self._failure is not None:
            raise self._failure
        request = self.request
        if self._writer is None:
            stored = [self.storage.store_layer(layer) for layer in layers]
            encoded = encode_kv(layers_to_host(stored), request.request_id, self.model_id,
                                self.revision, self.storage.scale)
            handoff = KVHandoff(encoded.header, request.prompt_token_ids, first.token_id,
                                request.sampling, request.compression, request.decode_incarnation,
                                request.cache_salt, first.prefill_s, first.partition)
            self.num_bytes = encoded.header.total_bytes
            self.push.send(framing.messages(handoff, encoded.chunk_pieces()) if self.source is None
                           else framing.nixl_messages(handoff, encoded.segments, self.source),
                           self.source)
            return
        self._writer.first_token(first)
        last = self._checked(len(layers) - 1, layers[-1])
        self._send(layers_to_host([last])[0])
        self._writer.finish()
        self.push.end(self.source)

    def _end_span(self, error: Exception | None = None) -> None:
        span, self.span = self.span, None
        tracing.end(span, attributes={"baton.kv.bytes": self.num_bytes}, error=error)

    def cancel(self) -> None:
        if self._failure is None:
            self._failure = RuntimeError("the shipment was cancelled")  # queued layers stop
        self._end_span(self._failure)
        self.push.cancel()
        if self._queued is not None:
            # the layer the shipper may be sending still reads the NIXL source's memory
            concurrent.futures.wait([self._queued])
        if self.source is not None:
            self.source.release()

    def _checked(self, index: int, layer: LayerKV) -> LayerKV:
        """A finished layer as it goes out: prepared (compressed when the request compresses),
        of the size the header announced, stored as the pod's pool stores it."""
        if self.prepare is not None:
            layer = self.prepare(index, layer)
        announced = self._header.layer_num_tokens[index]
        if layer.num_tokens != announced:
            raise KVMalformed(f"layer {index} keeps {layer.num_tokens} tokens; the header "
                              f"announced {announced}")
        return self.storage.store_layer(layer)

    def _send(self, layer: LayerKV) -> None:
        """A checked layer's bytes (in host memory) onto the push."""
        segments = layer_segments(layer)
        self.num_bytes += sum(len(segment) for segment in segments)
        self._writer.layer(segments)
        if self.source is not None:  # the pod's reads of the layers before this one
            self.source.progress()
class PushCall:
    """A Decode.PushKV call opened before its messages exist: they are fed to it later."""

    def __init__(self, method: grpc.StreamUnaryMultiCallable, traceparent: str = "") -> None:
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._future = method.future(iter(self._messages.get, None), timeout=PUSH_TIMEOUT_S,
                                     metadata=tracing.metadata(traceparent))

    def send(self, messages, source: NixlSource | None = None) -> None:
        """Send every message, then wait for the pod's answer (raises its status); with the
        NIXL ``source`` the pod reads from, serving its reads meanwhile."""
        try:
            for message in messages:
                self._messages.put(message)
        finally:
            self._messages.put(None)  # the stream's end (a half-sent one fails on the pod)
        self._answer(source)

    def put(self, message) -> None:
        """Send one message (it leaves in order, from gRPC's thread)."""
        self._messages.put(message)

    def end(self, source: NixlSource | None = None) -> None:
        """End the stream and wait for the pod's answer (raises its status; ``send``)."""
        self._messages.put(None)
        self._answer(source)

    def _answer(self, source: NixlSource | None) -> None:
        if source is None:
            self._future.result()
        else:
            source.answer(self._future)

    def cancel(self) -> None:
        self._messages.put(None)
        self._future.cancel()


class Pushes:
    """A tail's pushes: one channel per decode pod (mTLS when on; all anew once the
    certificates rotate), a push opened per request, over NIXL where the pod reads that way
    and this process has an agent (``nixl``; None: gRPC to every pod)."""

    def __init__(self, mtls: Mtls, nixl: NixlAgent | None, model_id: str, revision: str) -> None:
        self.mtls = mtls
        self.nixl = nixl
        self.model_id, self.revision = model_id, revision
        self._channels: dict[str, grpc.Channel] = {}
        self._fingerprint = mtls.fingerprint()

    def open(self, details: bytes, request: PrefillRequest, storage: KVStorage,
             prepare: Callable[[int, LayerKV], LayerKV] | None = None,
             shipper: concurrent.futures.Executor | None = None) -> Shipment:
        """A request's shipment, its PushKV call opened now: the call's setup (a stream, the
        pod's handler) costs milliseconds, which the chain's compute hides when it is opened
        before."""
        method = framing.stub_push_kv(self._channel(request.decode_address))
        source = (NixlSource(self.nixl) if self.nixl is not None
                  and request.decode_kv_transport == NIXL else None)
        span = (tracing.start("baton.kv.push", request.traceparent, attributes={
            "baton.request_id": request.request_id, "baton.kv.decode": request.decode_address,
            "baton.kv.transport": NIXL if source is not None else "grpc"})
            if request.traceparent else None)
        return Shipment(details, request, PushCall(method, tracing.traceparent(span)), storage,
                        prepare,
                        self.model_id, self.revision, source, shipper, span)

    def _channel(self, address: str) -> grpc.Channel:
        fingerprint = self.mtls.fingerprint()
        if fingerprint != self._fingerprint:
            self.close()
            self._channels, self._fingerprint = {}, fingerprint
        if address not in self._channels:
            self._channels[address] = self.mtls.channel(address, CHANNEL_OPTIONS)
        return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
