"""A decode pod's queue of prompts waiting for their prefill is bounded by count (and by
tokens): beyond it a request is refused at once with RESOURCE_EXHAUSTED and the numbers."""

from __future__ import annotations

import pytest
from baton.api import convert
from baton.api.requests import CompressionParams, DecodeRequest
from baton.config import KVPoolConfig
from baton.decode.worker import DecodeWorker
from baton.errors import ResourceExhausted
from baton.metrics import DecodeMetrics
from baton.model.loader import load_checkpoint
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from decode_servers import make_checkpoint
from prometheus_client import CollectorRegistry


def request(request_id: str) -> DecodeRequest:
    return DecodeRequest(request_id, (5, 17, 99), SamplingParams(temperature=0.0, max_tokens=4),
                         CompressionParams())


def test_prompts_beyond_the_queue_limit_are_resource_exhausted(tmp_path):
    loaded = load_checkpoint(make_checkpoint(tmp_path), dtype="float32")
    engine = Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(num_blocks=64))
    worker = DecodeWorker(engine, "here:1", DecodeMetrics(CollectorRegistry(), "m"), max_queued_requests=2)
    # the engine loop is not started: every accepted prompt stays queued
    worker.submit_prompt(request("a"))
    worker.submit_prompt(request("b"))
    with pytest.raises(ResourceExhausted, match="2 requests wait for a prefill on this pod, at most 2"):
        worker.submit_prompt(request("c"))
    assert convert.status_for(ResourceExhausted("x")).name == "RESOURCE_EXHAUSTED"
    assert set(worker._streams) == {"a", "b"}  # the refused one left nothing behind
