"""The chain's tail: sample the first token, compress, ship the cache to the decode pod.

Per request, in the tail's chain loop (``ChainSink.deliver``): read the request's details
from rank 0 (``ChainExchange``), sample the first token from the tail's logits with the
request's sampler and report it at once (rank 0 streams it to the caller before any byte of
KV moves), encode the cache (``baton.kv.wire``; PyramidInfer-compressed by the observer
when the request's settings enable it), push it with Decode.PushKV to the address the
gateway chose, and report "shipped" with its sizes and times, or the push's error.

Compression is decided per request: ``make_observer(C)`` is called by the chain for each
request before the tail computes its slice, and builds a ``PromptCompressor`` only when the
deployment's settings with the request's overrides (``baton.pyramid.request_config``) say so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from baton.api import convert
from baton.api.requests import KVHandoff, PrefillRequest
from baton.api.v1 import decode_pb2_grpc
from baton.config import MtlsConfig, PyramidConfig
from baton.kv.wire import encode_kv
from baton.metrics import PrefillMetrics
from baton.model.config import ModelConfig
from baton.model.sampling import Sampler
from baton.mtls import Mtls
from baton.prefill.exchange import ChainExchange
from baton.pyramid import PromptCompressor, compressor_factory, request_config
from baton.runahead.request import ChainResult
from baton.serving import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 120.0  # one cache over gRPC; at ~1 GB/s even a large cache takes seconds


class TailSink:
    """The tail's ``ChainSink`` (and its ``make_observer``)."""

    def __init__(self, exchange: ChainExchange, model_config: ModelConfig, model_id: str,
                 revision: str, pyramid: PyramidConfig, metrics: PrefillMetrics,
                 current_request: Callable[[], int], timeout_s: float,
                 on_ready: Callable[[], None] = lambda: None,
                 on_fail: Callable[[str], None] = lambda message: None,
                 mtls: Mtls | None = None) -> None:
        self.exchange = exchange
        self.model_config = model_config
        self.model_id = model_id
        self.revision = revision
        self.pyramid = pyramid
        self.metrics = metrics
        self.current_request = current_request  # the chain request id being computed
        self.timeout_s = timeout_s
        self.on_ready = on_ready
        self.on_fail = on_fail
        self.mtls = mtls or Mtls(MtlsConfig())
        self._requests: dict[int, PrefillRequest] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._generation = self.mtls.generation()

    # --- ChainSink -------------------------------------------------------------------------

    def ready(self) -> None:
        self.on_ready()

    def fail(self, rank: int, request_id: int, message: str) -> None:
        log.error("prefill chain broken at rank %d: %s", rank, message)
        self.on_fail(message)

    def make_observer(self, prompt_length: int) -> PromptCompressor | None:
        """The compression observer of the request about to be computed (None = keep all)."""
        chain_request_id = self.current_request()
        request = self.exchange.read_request(chain_request_id, self.timeout_s)
        self._requests[chain_request_id] = request
        settings = request_config(self.pyramid, request.compression.enabled,
                                  request.compression.keep_ratio)
        # The request's own settings, not the deployment's: its keep_ratio holds here too.
        return compressor_factory(settings, self.model_config)(prompt_length) if settings.enabled else None

    def deliver(self, result: ChainResult) -> None:
        chain_request_id = result.request_id
        request = self._requests.pop(chain_request_id, None)
        if request is None:
            request = self.exchange.read_request(chain_request_id, self.timeout_s)
        try:
            self._ship(chain_request_id, request, result)
        except Exception as e:  # noqa: BLE001 - one request's failure is reported, the chain goes on
            code = e.code().name if isinstance(e, grpc.RpcError) else convert.status_for(e).name
            details = e.details() if isinstance(e, grpc.RpcError) else str(e)
            log.warning("request %s not shipped: %s %s", request.request_id, code, details)
            self.metrics.requests_finished.labels(outcome="failed").inc()
            self.exchange.report_error(chain_request_id, code, f"shipping the KV of "
                                       f"{request.request_id!r} to {request.decode_address}: "
                                       f"{details}")

    # --- one request -----------------------------------------------------------------------

    def _ship(self, chain_request_id: int, request: PrefillRequest, result: ChainResult) -> None:
        first_token = Sampler(request.sampling).sample(result.first_token_logits, position=0)
        self.exchange.report(chain_request_id, "first",
                             {"token_id": first_token, "partition": list(result.boundaries)})
        self.metrics.record_partition(result.boundaries)
        self.metrics.record_prefill(len(request.prompt_token_ids), result.ttft_s)
        if self.exchange.is_aborted(chain_request_id):
            self.exchange.report_error(chain_request_id, "ABORTED",
                                       f"request {request.request_id!r} was aborted")
            self.metrics.requests_finished.labels(outcome="aborted").inc()
            return
        layers = result.layers
        full = len(request.prompt_token_ids) * len(layers)
        kept = sum(layer.num_tokens for layer in layers)
        push_start = time.monotonic()
        encoded = encode_kv(layers, request.request_id, self.model_id, self.revision)
        handoff = KVHandoff(encoded.header, request.prompt_token_ids, first_token,
                            request.sampling, request.compression, request.decode_incarnation,
                            request.cache_salt)
        stub = decode_pb2_grpc.DecodeStub(self._channel(request.decode_address))
        stub.PushKV(convert.push_kv_messages(handoff, encoded.chunks()), timeout=PUSH_TIMEOUT_S)
        push_s = time.monotonic() - push_start
        self.exchange.report(chain_request_id, "done", {
            "kv_bytes": encoded.header.total_bytes, "kv_tokens_kept": kept, "kv_tokens_full": full,
            "prefill_s": result.ttft_s, "kv_push_s": push_s})
        self.metrics.kv_bytes_shipped.inc(encoded.header.total_bytes)
        self.metrics.compression_ratio.observe(kept / full)
        self.metrics.kv_push_s.observe(push_s)
        self.metrics.requests_finished.labels(outcome="shipped").inc()

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
