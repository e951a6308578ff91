"""The chain's tail (``TailSink``) shipping a cache to a real decode pod, driven as a chain drives
it: layer by layer while the chain computes, then the logits. With the model on a GPU the
layers go through the tail's shipper thread once their copies reach the host; here the model
is on the CPU and ``kv_device`` says "cuda" to take that path (``to_host`` hands host tensors
back as they are), so its ordering and its failures are checked on any machine."""

from __future__ import annotations

import grpc
import pytest
import torch
from baton.api.v1 import common_pb2, decode_pb2, prefill_pb2
from baton.config import PyramidConfig
from baton.kv import DenseKV
from baton.metrics import PrefillMetrics
from baton.model import prefill
from baton.model.loader import load_checkpoint
from baton.prefill.tail import TailSink
from baton.runahead.request import ChainResult
from decode_servers import MAX_TOKENS, PROMPT, collect
from prometheus_client import CollectorRegistry

LOST_PUSH_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED)


def computed(checkpoint):
    """What a chain's tail holds once the prompt is computed: its logits and every layer."""
    loaded = load_checkpoint(checkpoint, dtype="float32", with_tokenizer=False)
    kv = DenseKV(loaded.config.num_hidden_layers)
    logits = prefill(loaded.model, torch.tensor(PROMPT), torch.arange(len(PROMPT)), kv)
    return loaded, logits, kv.complete_layers()


def tail(loaded, details: bytes, device: str) -> TailSink:
    return TailSink(loaded.config, loaded.model_id, loaded.revision, PyramidConfig(enabled=False),
                    PrefillMetrics(CollectorRegistry(), "m"), lambda: details, by_layer=True,
                    kv_device=lambda: torch.device(device))


def details_of(request_id: str, address: str) -> bytes:
    return prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=PROMPT, decode_address=address,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)).SerializeToString()


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["sent by the chain", "sent by the shipper"])
def test_a_cache_shipped_by_layer_decodes_like_the_monolithic_engine(server, stub, checkpoint,
                                                                     reference, device):
    loaded, logits, layers = computed(checkpoint)
    request_id = f"tail-{device}"
    details = details_of(request_id, server.address)
    attach = stub.Attach(decode_pb2.AttachRequest(request_id=request_id, wait_s=20), timeout=30)
    sink = tail(loaded, details, device)
    try:
        sink.make_observer(len(PROMPT))  # opens the push and sends its header
        for index, layer in enumerate(layers[:-1]):
            sink.on_layer(index, layer)
        sink.deliver(ChainResult(1, logits, layers, [0, len(PROMPT)], "runahead", 0.01, [], details))
    finally:
        sink.close()
    tokens, messages = collect(attach)
    assert tokens == reference
    assert messages[-1].usage.kv_tokens_kept == len(PROMPT) * len(layers)
    assert sink.metrics.requests_finished.labels(outcome="shipped")._value.get() == 1


def ship(sink, loaded, logits, layers, chain_id: int, details: bytes, broken_layer: int = -1):
    """Drive ``sink`` as the chain does; layer ``broken_layer`` arrives a token short."""
    sink.current_details = lambda: details
    sink.make_observer(len(PROMPT))
    for index, layer in enumerate(layers[:-1]):
        if index == broken_layer:
            layer = type(layer)(layer.k[:-1], layer.v[:-1], layer.positions[:-1])
        sink.on_layer(index, layer)
    sink.deliver(ChainResult(chain_id, logits, layers, [0, len(PROMPT)], "runahead", 0.01, [], details))


def test_a_layer_that_cannot_go_out_fails_its_request_and_the_tail_ships_the_next(
        server, stub, checkpoint, reference):
    loaded, logits, layers = computed(checkpoint)
    broken = details_of("tail-broken", server.address)
    attach = stub.Attach(decode_pb2.AttachRequest(request_id="tail-broken", wait_s=3), timeout=30)
    sink = tail(loaded, broken, "cuda")
    try:
        ship(sink, loaded, logits, layers, 2, broken, broken_layer=0)
        assert sink.metrics.requests_finished.labels(outcome="failed")._value.get() == 1
        # the push was cancelled: the pod never took its header (the request is not there) or
        # lost the push after it (the stream fails); either way a status naming the request
        with pytest.raises(grpc.RpcError) as failure:
            collect(attach)
        assert failure.value.code() in LOST_PUSH_CODES
        assert "tail-broken" in failure.value.details()
        good = details_of("tail-after-broken", server.address)
        attach = stub.Attach(decode_pb2.AttachRequest(request_id="tail-after-broken", wait_s=20),
                             timeout=30)
        ship(sink, loaded, logits, layers, 3, good)
    finally:
        sink.close()
    assert collect(attach)[0] == reference
    assert sink.metrics.requests_finished.labels(outcome="shipped")._value.get() == 1
