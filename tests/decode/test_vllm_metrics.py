"""A decode pod's engine serving prompts exports vLLM's series under vLLM's names and labels:
the queue and KV gauges move under load, the pool's geometry is in ``vllm:cache_config_info``,
and the token counters and latency histograms count what the streams carried."""

from __future__ import annotations

import threading

import pytest
from baton.api.requests import CompressionParams, DecodeRequest
from baton.config import KVPoolConfig, SchedulerConfig
from baton.decode.worker import DecodeWorker
from baton.metrics import DecodeMetrics
from baton.model.loader import load_checkpoint
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from decode_servers import make_checkpoint
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny-served"
NUM_REQUESTS = 6
MAX_TOKENS = 8
SHARED_PREFIX = [5, 17, 99, 3, 250, 42, 7, 7]  # two blocks of 4: later prompts may hit the cache


def scrape(registry) -> dict[str, list]:
    """Sample name -> [(labels, value)] of the registry's text, as a scraper parses it."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples, name: str, **labels) -> float:
    (found,) = [v for have, v in samples[name] if labels.items() <= have.items()]
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Serve NUM_REQUESTS prompts, at most two running at once, scraping after every step."""
    loaded = load_checkpoint(make_checkpoint(tmp_path_factory.mktemp("model")), dtype="float32")
    engine = Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(block_size=4, num_blocks=384),
                    scheduler=SchedulerConfig(max_running=2, token_budget=64))
    registry = CollectorRegistry()
    worker = DecodeWorker(engine, "here:1", DecodeMetrics(registry, MODEL_NAME))
    scrapes, done = [], threading.Event()
    streams = []

    def after_step(touched) -> None:
        scrapes.append(scrape(registry))
        if streams and all(stream.finished for stream in streams):
            done.set()

    worker.on_published = after_step
    for i in range(NUM_REQUESTS):
        request = DecodeRequest(f"r{i}", tuple(SHARED_PREFIX + [100 + i, 60 + i, 30 + i]),
                                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                CompressionParams())
        streams.append(worker.submit_prompt(request))
    worker.start()
    try:
        assert done.wait(300), "the requests did not finish"
    finally:
        worker.stop()
    return engine, streams, scrapes, scrape(registry)


def test_queue_running_and_kv_usage_gauges_move_under_load(served):
    _, _, during, after = served
    labels = {"model_name": MODEL_NAME, "engine": "0"}
    assert max(value(s, "vllm:num_requests_waiting", **labels) for s in during) > 0
    assert max(value(s, "vllm:num_requests_running", **labels) for s in during) > 0
    usage = [value(s, "vllm:kv_cache_usage_perc", **labels) for s in during]
    assert any(0 < u < 1 for u in usage) and all(0 <= u <= 1 for u in usage)
    # all done: nothing queued or running, and cached blocks nobody holds count as free
    assert value(after, "vllm:num_requests_waiting") == value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_cache_config_info_is_the_pools_geometry_in_vllms_blocks(served):
    engine, _, _, after = served
    ((labels, one),) = after["vllm:cache_config_info"]
    assert one == 1
    pool = engine.pool
    assert labels == {"engine": "0", "block_size": str(pool.block_size),
                      "num_gpu_blocks": str(pool.num_blocks // pool.num_layers),
                      "enable_prefix_caching": "True"}
    assert int(labels["num_gpu_blocks"]) * pool.block_size == engine.memory.capacity_tokens()


def test_token_counters_and_latency_counts_follow_the_streams(served):
    engine, streams, _, after = served
    generated = [stream.num_tokens for stream in streams]
    assert generated == [MAX_TOKENS] * NUM_REQUESTS
    assert value(after, "vllm:generation_tokens_total") == sum(generated)
    assert value(after, "vllm:prompt_tokens_total") == sum(s.num_prompt_tokens for s in streams)
    # one inter-token latency per token after each request's first
    assert value(after, "vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in generated)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert value(after, f"{name}_count") == NUM_REQUESTS
    assert value(after, "vllm:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert value(after, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(after, "vllm:num_preemptions_total") == engine.num_preemptions
    # the prefix cache in tokens, as baton's own series count them
    assert value(after, "vllm:prefix_cache_queries_total") == value(
        after, "baton_decode_prefix_cache_prompt_tokens_total") > 0
    assert value(after, "vllm:prefix_cache_hits_total") == value(
        after, "baton_decode_prefix_cache_hit_tokens_total")


def test_names_types_and_label_sets_are_vllms(served):
    *_, after = served
    families = {family.name: family for family in text_string_to_metric_families(
        generate_latest(DecodeMetrics(CollectorRegistry(), MODEL_NAME).registry).decode())}
    expected = {
        "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter", "vllm:request_success": "counter"}
    assert {name: families[name].type for name in expected} == expected
    for name, samples in after.items():
        if not name.startswith("vllm:") or name.startswith("vllm:cache_config_info"):
            continue
        for labels, _ in samples:
            extra = set(labels) - {"model_name", "engine"}
            assert labels["model_name"] == MODEL_NAME and labels["engine"] == "0"
            assert extra <= ({"le"} if name.endswith("_bucket") else
                             {"finished_reason"} if name.startswith("vllm:request_success") else set())
    buckets = [float(labels["le"]) for labels, _ in after["vllm:inter_token_latency_seconds_bucket"]]
    assert buckets[:3] == [0.01, 0.025, 0.05] and buckets[-2:] == [80.0, float("inf")]
