"""The chain's tail: sample the first token, compress, ship the cache to the decode pod.

Per request: the request's details came with its broadcast (the service's
``PrefillRequest``); before the tail computes (``make_observer``) it reads them and opens the
push (Decode.PushKV) to the decode pod the gateway chose. Shipping by layer (the default),
the header goes out at once and each layer (``baton.transfer.codec``; PyramidInfer-compressed when
the request's settings enable it) as the chain finishes it (``on_layer``); once the logits
exist (``deliver``) the tail samples the first token with the request's sampler and sends
it, with the chain's figures, ahead of the last layer. After prefill, the whole cache goes
then, the first token on its header. The decode pod streams the token to the caller as
soon as it checks out, before the KV has landed. To a decode pod that reads over NIXL (the
gateway passes on what its routing record says), when this tail has NIXL too, the bytes stay
in the tail's memory for the pod to read (``baton.transfer.nixl``); only where they lie goes on
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
import time
from collections.abc import Callable

import grpc
import torch

from baton.api import convert
from baton.api.requests import PrefillRequest
from baton.api.v1 import prefill_pb2
from baton.config import MtlsConfig, PyramidConfig
from baton.kv.dense import LayerKV
from baton.kv.storage import KVStorage
from baton.metrics import PrefillMetrics
from baton.model.config import ModelConfig
from baton.pyramid import PromptCompressor, check_model, compressor_factory, request_config
from baton.runahead.request import ChainResult
from baton.sampling.grammars import ModelGrammars
from baton.sampling.sampler import Draw, Sampler, draw
from baton.security.mtls import Mtls
from baton.transfer.codec import kv_header
from baton.transfer.handoff import FirstToken
from baton.transfer.nixl import NixlAgent
from baton.transfer.sender import Pushes, Shipment

log = logging.getLogger(__name__)

class TailSink:
    """The tail's ``ChainSink`` (with its ``make_observer`` and ``on_layer``)."""

    def __init__(self, model_config: ModelConfig, model_id: str,
                 revision: str, pyramid: PyramidConfig, metrics: PrefillMetrics,
                 current_details: Callable[[], bytes],
                 on_ready: Callable[[], None] = lambda: None,
                 on_fail: Callable[[str], None] = lambda message: None,
                 mtls: Mtls | None = None, by_layer: bool = False,
                 kv_storage: Callable[[], KVStorage] = lambda: KVStorage(torch.float32),
                 nixl: NixlAgent | None = None,
                 kv_device: Callable[[], torch.device] = lambda: torch.device("cpu"),
                 grammars: ModelGrammars | None = None) -> None:
        """``by_layer``: ship each layer as it is computed (``on_layer``), the first token
        before the last layer; otherwise the whole cache once the logits exist, the first
        token on the header. ``kv_storage``: what the cache ships as (fp8 with its scale, or
        the model's dtype); it and ``kv_device`` are known once the model is loaded (by
        layer from a GPU, a thread of the tail's sends each layer once its copy to the host is
        done, while the chain computes on). ``nixl``: this process's agent, for pods that read
        over NIXL (None: gRPC to every pod). ``grammars``: the structured outputs' (None:
        a request with one fails)."""
        if pyramid.enabled:  # refused at start, not on the first request
            check_model(model_config)
        self.model_config = model_config
        self.grammars = grammars
        self.model_id = model_id
        self.revision = revision
        self.pyramid = pyramid
        self.metrics = metrics
        self.current_details = current_details  # the details of the request being computed
        self.on_ready = on_ready
        self.on_fail = on_fail
        self.pushes = Pushes(mtls or Mtls(MtlsConfig()), nixl, model_id, revision)
        self.by_layer = by_layer
        self.kv_storage = kv_storage
        self.kv_device = kv_device
        self._shipper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-shipper")
        # The request being computed, read and its push opened before the chain computes it:
        # off the first token's path.
        self._computing: Shipment | None = None

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
        storage = self.kv_storage()
        self._computing = self.pushes.open(details, request, storage,
                                           compressor.compress_layer if compressor else None,
                                           shipper)
        if self.by_layer:
            kept = compressor.kept_counts() if compressor else (
                (prompt_length,) * self.model_config.num_hidden_layers)
            self._computing.begin_by_layer(
                kv_header(kept, storage.dtype, self.model_config.num_key_value_heads,
                          self.model_config.head_dim, request.request_id, self.model_id,
                          self.revision, storage.scale))
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
            shipment = self.pushes.open(result.details, request, self.kv_storage())
        request = shipment.request
        try:
            push_start = time.monotonic()
            first = first_draw(request, result.first_token_logits, self.model_config.eos_token_ids,
                               self.grammars)
            shipment.finish(FirstToken(first.token_id, result.ttft_s, tuple(result.boundaries),
                                       first.logprobs),
                            result.layers)
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

    def close(self) -> None:
        self.pushes.close()
        self._shipper.shutdown(wait=False)


def first_draw(request: PrefillRequest, logits, eos_token_ids,
               grammars: ModelGrammars | None = None) -> Draw:
    """The request's first token from the chain's last logits, drawn as a decode pod draws it
    (under its grammar's mask too)."""
    params = request.sampling
    grammar = None
    if params.structured is not None:
        if grammars is None:
            raise ValueError("this chain's tail cannot apply structured outputs")
        grammar = grammars.state(params.structured)
    sampler = Sampler(params, request.prompt_token_ids, params.stop_ids(eos_token_ids),
                      grammar=grammar)
    return draw(logits[None, :], [sampler], [0])[0]


def read_details(details: bytes) -> PrefillRequest:
    """The service's request behind a chain request (what rank 0 broadcast with it)."""
    message = prefill_pb2.PrefillRequest()
    message.ParseFromString(details)
    return convert.prefill_request_from_proto(message)
