"""The gateway observes vLLM's request latencies of the requests a chain prefilled (their
decode pod saw only the push arrive), and leaves those prefilled on a decode pod to it."""

from __future__ import annotations

import time

from baton.api.requests import FinishReason, GenerationStep, Usage
from baton.gateway.generations import StreamClock
from baton.metrics import GatewayMetrics
from prometheus_client import CollectorRegistry


def stream(kv_bytes_shipped: int) -> CollectorRegistry:
    metrics = GatewayMetrics(CollectorRegistry(), "served")
    clock = StreamClock(metrics, "chain", time.monotonic())
    clock.stamp(GenerationStep("r", token_ids=(1,)))
    clock.stamp(GenerationStep("r", token_ids=(2,)))
    clock.stamp(GenerationStep("r", token_ids=(3,), finish_reason=FinishReason.LENGTH,
                               usage=Usage(prompt_tokens=4, completion_tokens=3,
                                           kv_bytes_shipped=kv_bytes_shipped)))
    return metrics.registry


def count(registry, name: str) -> float:
    return registry.get_sample_value(f"{name}_count", {"model_name": "served", "engine": "0"})


def test_a_pushed_request_is_observed_once_at_its_end():
    registry = stream(kv_bytes_shipped=4096)
    assert count(registry, "vllm:time_to_first_token_seconds") == 1
    assert count(registry, "vllm:e2e_request_latency_seconds") == 1


def test_a_prompt_prefilled_on_a_decode_pod_is_left_to_the_pod():
    registry = stream(kv_bytes_shipped=0)
    assert count(registry, "vllm:time_to_first_token_seconds") == 0
    assert count(registry, "vllm:e2e_request_latency_seconds") == 0
