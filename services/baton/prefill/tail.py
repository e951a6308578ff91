"""The chain's tail: sample the first token, compress, ship the cache to the decode pod.

Per request: the request's details came with its broadcast (the service's
``PrefillRequest``); before the tail computes (``make_observer``) it reads them and opens the
push (Decode.PushKV) to the decode pod the gateway chose. Shipping by layer (the default),
the header goes out at once and each layer (``baton.kv.wire``; PyramidInfer-compressed when
the request's settings enable it) as the chain finishes it (``on_layer``); once the logits
exist (``deliver``) the tail samples the first token with the request's sampler and sends
it, with the chain's figures, ahead of the last layer. After prefill, the whole cache goes
then, the first token on its header. The decode pod streams the token to the caller as
soon as it checks out, before the KV has landed. To a decode pod that reads over NIXL (the
gateway passes on what its routing record says), when this tail has NIXL too, the bytes stay
in the tail's memory for the pod to read (``baton.kv.nixl``); only where they lie goes on
the stream. Nothing goes back to rank 0: the decode
pod is the request's only source of tokens and of news. A push the decode pod refuses or
loses fails the request's stream there; one that cannot reach the pod at all is logged
(the pod is gone, and the caller's stream with it).

Compression is decided per request: ``make_observer(C)`` is called by the chain for each
request before the tail computes its slice, and builds a ``PromptCompressor`` only when the
deployment's settings with the request's overrides (``baton.pyramid.request_config``) say so.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable

import grpc
import torch

from baton.api import convert, push_kv
from baton.api.requests import FirstToken, KVHandoff, PrefillRequest
from baton.api.v1 import prefill_pb2
from baton.config import MtlsConfig, PyramidConfig
from baton.kv.dense import LayerKV
from baton.kv.device_copy import HostCopy, layers_to_host, to_host
from baton.kv.nixl import NIXL, NixlAgent, NixlSource
from baton.kv.wire import KVHeader, KVMalformed, encode_kv, kv_header, layer_segments
from baton.metrics import PrefillMetrics
from baton.model.config import ModelConfig
from baton.model.sampling import Sampler
from baton.pyramid import PromptCompressor, compressor_factory, request_config
from baton.runahead.request import ChainResult
from baton.security.mtls import Mtls
from baton.serving import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 120.0  # one cache over gRPC; at ~1 GB/s even a large cache takes seconds


class TailSink:
    """The tail's ``ChainSink`` (with its ``make_observer`` and ``on_layer``)."""

    def __init__(self, model_config: ModelConfig, model_id: str,
                 revision: str, pyramid: PyramidConfig, metrics: PrefillMetrics,
                 current_details: Callable[[], bytes],
                 on_ready: Callable[[], None] = lambda: None,
                 on_fail: Callable[[str], None] = lambda message: None,
                 mtls: Mtls | None = None, by_layer: bool = False,
                 kv_dtype: Callable[[], torch.dtype] = lambda: torch.float32,
                 nixl: NixlAgent | None = None,
                 kv_device: Callable[[], torch.device] = lambda: torch.device("cpu")) -> None:
        """``by_layer``: ship each layer as it is computed (``on_layer``), the first token
        before the last layer; otherwise the whole cache once the logits exist, the first
        token on the header. ``kv_dtype``, ``kv_device``: the model's, once it is loaded (by
        layer from a GPU, a thread of the tail's sends each layer once its copy to the host is
        done, while the chain computes on). ``nixl``: this process's agent, for pods that read
        over NIXL (None: gRPC to every pod)."""
        self.model_config = model_config
        self.model_id = model_id
        self.revision = revision
        self.pyramid = pyramid
        self.metrics = metrics
        self.current_details = current_details  # the details of the request being computed
        self.on_ready = on_ready
        self.on_fail = on_fail
        self.mtls = mtls or Mtls(MtlsConfig())
        self.by_layer = by_layer
        self.kv_dtype = kv_dtype
        self.kv_device = kv_device
        self.nixl = nixl
        self._shipper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-shipper")
        self._channels: dict[str, grpc.Channel] = {}
        # The request being computed, read and its push opened before the chain computes it:
        # off the first token's path.
        self._computing: Shipment | None = None
        self._generation = self.mtls.generation()

    # --- ChainSink -------------------------------------------------------------------------

    def ready(self) -> None:
        self.on_ready()

    def fail(self, rank: int, request_id: int, message: str) -> None:
        log.error("prefill chain broken at rank %d: %s", rank, message)
        self.on_fail(message)

    def make_observer(self, prompt_length: int) -> PromptCompressor | None:
        """The compression observer of the request about to be computed (None = keep all);
        its push opens now, and when it ships by layer its header goes out now."""
        details = self.current_details()
        request = read_details(details)
        settings = request_config(self.pyramid, request.compression.enabled,
                                  request.compression.keep_ratio)
        # The request's own settings, not the deployment's: its keep_ratio holds here too.
        compressor = (compressor_factory(settings, self.model_config)(prompt_length)
                      if settings.enabled else None)
        if self._computing is not None:  # the chain moved on without delivering it
            self._computing.cancel()
        shipper = self._shipper if self.kv_device().type == "cuda" else None
        self._computing = Shipment(details, request, self._open_push(request), compressor,
                                   self.model_id, self.revision, self._nixl_source(request),
                                   shipper)
        if self.by_layer:
            kept = compressor.kept_counts() if compressor else (
                (prompt_length,) * self.model_config.num_hidden_layers)
            self._computing.begin_by_layer(
                kv_header(kept, self.kv_dtype(), self.model_config.num_key_value_heads,
                          self.model_config.head_dim, request.request_id, self.model_id,
                          self.revision))
        return compressor

    def on_layer(self, index: int, layer: LayerKV) -> None:
        """A layer the chain has finished, but the last: it goes out now (by layer)."""
        if self._computing is not None:
            self._computing.ship_layer(index, layer)

    def deliver(self, result: ChainResult) -> None:
        shipment, self._computing = self._computing, None
        if shipment is None or shipment.details != result.details:
            if shipment is not None:
                shipment.cancel()
            request = read_details(result.details)
            shipment = Shipment(result.details, request, self._open_push(request), None,
                                self.model_id, self.revision, self._nixl_source(request))
        request = shipment.request
        try:
            push_start = time.monotonic()
            shipment.finish(result)
            self.metrics.kv_push_s.observe(time.monotonic() - push_start)
        except Exception as e:  # noqa: BLE001 - one request's failure is logged, the chain goes on
            shipment.cancel()  # (a no-op once the pod has answered)
            code = e.code().name if isinstance(e, grpc.RpcError) else convert.status_for(e).name
            details = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.warning("request %s not shipped to %s: %s %s", request.request_id,
                        request.decode_address, code, details)
            self.metrics.requests_finished.labels(outcome="failed").inc()
            return
        self.metrics.record_partition(result.boundaries)
        self.metrics.record_prefill(len(request.prompt_token_ids), result.ttft_s)
        full = len(request.prompt_token_ids) * len(result.layers)
        kept = sum(layer.num_tokens for layer in result.layers)
        self.metrics.kv_bytes_shipped.inc(shipment.num_bytes)
        self.metrics.compression_ratio.observe(kept / full)
        self.metrics.requests_finished.labels(outcome="shipped").inc()

    # --- one request -----------------------------------------------------------------------

    def _open_push(self, request: PrefillRequest) -> PushCall:
        """The request's PushKV call, opened now: its setup (a stream, the pod's handler) costs
        ~2 ms, which the chain's compute hides when it is opened before it."""
        return PushCall(push_kv.stub_push_kv(self._channel(request.decode_address)))

    def _nixl_source(self, request: PrefillRequest) -> NixlSource | None:
        """Where the request's bytes wait for the pod's NIXL read (None: they go on the stream)."""
        if self.nixl is None or request.decode_kv_transport != NIXL:
            return None
        return NixlSource(self.nixl)

    def _channel(self, address: str) -> grpc.Channel:
        """A channel per decode pod (mTLS when on); all anew once the certificates rotate."""
        generation = self.mtls.generation()
        if generation != self._generation:
            self.close()
            self._channels, self._generation = {}, generation
        if address not in self._channels:
            self._channels[address] = self.mtls.channel(address, CHANNEL_OPTIONS)
        return self._channels[address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._shipper.shutdown(wait=False)


class Shipment:
    """One request's KV on its way to the decode pod, over its open ``PushCall``.

    By layer (``begin_by_layer``): the header at once, each layer as the chain finishes it
    (compressed first when the request compresses), then, once the logits exist, the first
    token, the last layer and the trailer. Otherwise (``finish`` alone): the header with the
    first token, then the whole cache. With a NIXL ``source``, where each layer's (or the
    cache's) bytes lie goes in place of the bytes, which stay registered until the pod has
    answered (or the push is cancelled). A failure while layers go out (the pod refused the
    header, a layer is not what the header announced) never reaches the chain: the push is
    cancelled, and ``finish`` raises what happened."""

    def __init__(self, details: bytes, request: PrefillRequest, push: PushCall,
                 compressor: PromptCompressor | None, model_id: str, revision: str,
                 source: NixlSource | None = None,
                 shipper: concurrent.futures.Executor | None = None) -> None:
        """``shipper``: one thread that sends layers copied off a GPU, in order (None: every
        layer is sent by the caller)."""
        self.details = details
        self._shipper = shipper
        self._queued: concurrent.futures.Future | None = None  # the last layer given to it
        self.source = source
        self.model_id, self.revision = model_id, revision
        self.request = request
        self.push = push
        self.compressor = compressor
        self.num_bytes = 0
        self._writer: push_kv.LayerByLayer | None = None
        self._header: KVHeader | None = None
        self._failure: Exception | None = None

    def begin_by_layer(self, header: KVHeader) -> None:
        request = self.request
        self._header = header
        handoff = KVHandoff(header, request.prompt_token_ids, 0, request.sampling,
                            request.compression, request.decode_incarnation, request.cache_salt,
                            first_token_follows=True)
        self._writer = push_kv.LayerByLayer(handoff, self.push.put, self.source)

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

    def finish(self, result: ChainResult) -> None:
        """Send what is left (everything, unless by layer) and wait for the pod's answer."""
        try:
            self._finish(result)
        finally:
            if self.source is not None:
                self.source.release()

    def _finish(self, result: ChainResult) -> None:
        if self._queued is not None:
            self._queued.result()  # the shipper has sent every layer before the last
        if self._failure is not None:
            raise self._failure
        request = self.request
        first_token = Sampler(request.sampling).sample(result.first_token_logits, position=0)
        if self._writer is None:
            encoded = encode_kv(layers_to_host(result.layers), request.request_id, self.model_id,
                                self.revision)
            handoff = KVHandoff(encoded.header, request.prompt_token_ids, first_token,
                                request.sampling, request.compression, request.decode_incarnation,
                                request.cache_salt, result.ttft_s, tuple(result.boundaries))
            self.num_bytes = encoded.header.total_bytes
            self.push.send(push_kv.messages(handoff, encoded.chunk_pieces()) if self.source is None
                           else push_kv.nixl_messages(handoff, encoded.segments, self.source),
                           self.source)
            return
        self._writer.first_token(FirstToken(first_token, result.ttft_s, tuple(result.boundaries)))
        last = self._checked(len(result.layers) - 1, result.layers[-1])
        self._send(layers_to_host([last])[0])
        self._writer.finish()
        self.push.end(self.source)

    def cancel(self) -> None:
        if self._failure is None:
            self._failure = RuntimeError("the shipment was cancelled")  # queued layers stop
        self.push.cancel()
        if self._queued is not None:
            # the layer the shipper may be sending still reads the NIXL source's memory
            concurrent.futures.wait([self._queued])
        if self.source is not None:
            self.source.release()

    def _checked(self, index: int, layer: LayerKV) -> LayerKV:
        """A finished layer as it goes out: compressed when the request compresses, and of the
        size the header announced."""
        if self.compressor is not None:
            layer = self.compressor.compress_layer(index, layer)
        announced = self._header.layer_num_tokens[index]
        if layer.num_tokens != announced:
            raise KVMalformed(f"layer {index} keeps {layer.num_tokens} tokens; the header "
                              f"announced {announced}")
        return layer

    def _send(self, layer: LayerKV) -> None:
        """A checked layer's bytes (in host memory) onto the push."""
        segments = layer_segments(layer)
        self.num_bytes += sum(len(segment) for segment in segments)
        self._writer.layer(segments)
        if self.source is not None:  # the pod's reads of the layers before this one
            self.source.progress()
class PushCall:
    """A Decode.PushKV call opened before its messages exist: they are fed to it later."""

    def __init__(self, method: grpc.StreamUnaryMultiCallable) -> None:
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._future = method.future(iter(self._messages.get, None), timeout=PUSH_TIMEOUT_S)

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


def read_details(details: bytes) -> PrefillRequest:
    """The service's request behind a chain request (what rank 0 broadcast with it)."""
    message = prefill_pb2.PrefillRequest()
    message.ParseFromString(details)
    return convert.prefill_request_from_proto(message)
