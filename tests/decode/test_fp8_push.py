"""A chain's tail shipping to a decode pod whose pool holds fp8: the wire carries fp8 (the
keys and values in half of bf16's bytes, by the pod's own counter), the pod decodes it, and a
pod refuses a cache of another KV dtype rather than convert it."""

from __future__ import annotations

import pytest
import torch
from baton.api.v1 import decode_pb2
from baton.config import KVCacheConfig
from baton.kv.storage import KVStorage
from baton.runahead.request import ChainResult
from baton.transfer.codec import POSITION_BYTES, kv_header
from decode_servers import MAX_TOKENS, PROMPT, collect, decode_stub, start_decode_server
from test_tail_to_decode import computed, details_of, tail

FP8 = KVStorage(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def fp8_server(checkpoint, store):
    server, _ = start_decode_server(checkpoint, store, kv_cache=KVCacheConfig(dtype="fp8_e4m3"))
    yield server
    server.stop(0)


def push(server, checkpoint, request_id: str, storage: KVStorage | None):
    loaded, logits, layers = computed(checkpoint)
    details = details_of(request_id, server.address)
    sink = tail(loaded, details, "cpu")
    if storage is not None:
        sink.kv_storage = lambda: storage
    sink.make_observer(len(PROMPT))
    for index, layer in enumerate(layers[:-1]):
        sink.on_layer(index, layer)
    sink.deliver(ChainResult(1, logits, layers, [0, len(PROMPT)], "runahead", 0.01, [], details))
    sink.close()
    return sink, loaded


def test_an_fp8_push_ships_half_of_bf16s_bytes_and_decodes(fp8_server, checkpoint):
    channel, stub = decode_stub(fp8_server.port)
    attach = stub.Attach(decode_pb2.AttachRequest(request_id="fp8-1", wait_s=20), timeout=30)
    received = fp8_server.metrics.kv_bytes_received
    before = sum(sample.value for sample in received.collect()[0].samples
                 if sample.name.endswith("_total"))
    sink, loaded = push(fp8_server, checkpoint, "fp8-1", FP8)
    tokens, _ = collect(attach)
    channel.close()
    assert len(tokens) == MAX_TOKENS
    after = sum(sample.value for sample in received.collect()[0].samples
                if sample.name.endswith("_total"))
    config = loaded.config
    counts = (len(PROMPT),) * config.num_hidden_layers
    sizes = {dtype: kv_header(counts, dtype, config.num_key_value_heads, config.head_dim,
                              "r", "m", "v").total_bytes
             for dtype in (torch.float8_e4m3fn, torch.bfloat16)}
    positions = POSITION_BYTES * sum(counts)
    shipped = sink.metrics.kv_bytes_shipped._value.get()
    assert shipped == after - before == sizes[torch.float8_e4m3fn]
    assert 2 * (shipped - positions) == sizes[torch.bfloat16] - positions


def test_a_pod_refuses_a_cache_of_another_kv_dtype(fp8_server, checkpoint):
    sink, _ = push(fp8_server, checkpoint, "fp8-2", None)  # the chain ships float32
    assert sink.metrics.requests_finished.labels(outcome="failed")._value.get() == 1
