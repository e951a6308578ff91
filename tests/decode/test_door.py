"""A decode pod's own OpenAI door (``--http-port``, an InferencePool endpoint), in-process
over a tiny checkpoint and no chain: the `openai` client gets the monolithic engine's
tokens, the gateway's checks refuse what the gateway refuses, and the pod's ``/metrics`` on
the door's port (what the endpoint picker scrapes) shows vLLM's gauges move under load and
``vllm:cache_config_info`` naming the pool."""

from __future__ import annotations

import threading
import urllib.request

import openai
import pytest
from baton.config import (
    DecodeHttpConfig,
    DecodeServiceConfig,
    KVPoolConfig,
    ModelSourceConfig,
    RoutingConfig,
    SchedulerConfig,
)
from baton.decode.server import create_server
from baton.routing import InMemoryStore
from baton.serving import free_port
from decode_servers import KV_BLOCK_SIZE, KV_NUM_BLOCKS, MAX_TOKENS, PROMPT
from prometheus_client.parser import text_string_to_metric_families
from test_vllm_metrics import value

NUM_LOADED = 3  # requests at once against one running sequence: the rest wait


@pytest.fixture(scope="module")
def door(checkpoint):
    """A decode pod with its door on, one sequence running at a time."""
    config = DecodeServiceConfig(
        model=ModelSourceConfig(path=str(checkpoint), dtype="float32"),
        kv=KVPoolConfig(block_size=KV_BLOCK_SIZE, num_blocks=KV_NUM_BLOCKS),
        scheduler=SchedulerConfig(max_running=1, token_budget=64),
        routing=RoutingConfig(heartbeat_s=0.2, worker_ttl_s=2.0),
        http=DecodeHttpConfig(port=free_port()))
    config.server.grace_s = 0.5
    server, _ = create_server(config, InMemoryStore())
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def api(door):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{door.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=60)
    yield client
    client.close()


def scrape(door) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{door.http_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_the_door_is_off_unless_asked():
    assert DecodeServiceConfig().http.port == 0


def test_completions_stream_the_engines_greedy_tokens(api, reference):
    (model,) = api.models.list().data
    whole = api.completions.create(model=model.id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                   temperature=0.0, extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == reference
    streamed = []
    for chunk in api.completions.create(model=model.id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                        temperature=0.0, stream=True,
                                        extra_body={"return_token_ids": True}):
        streamed += chunk.choices[0].token_ids or [] if chunk.choices else []
    assert streamed == reference


def test_the_gateways_checks_refuse_at_the_door(api, door):
    before = sum(v for _, v in scrape(door).get("baton_decode_door_requests_refused_total", []))
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        api.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    too_long = door.door_router.model.info.max_model_len + 1
    with pytest.raises(openai.BadRequestError, match=str(too_long)):
        api.completions.create(model="", prompt=[5] * too_long, max_tokens=2)
    after = scrape(door)["baton_decode_door_requests_refused_total"]
    assert sum(v for _, v in after) == before + 2


def test_gauges_move_under_load_and_cache_config_is_the_pool(api, door):
    idle = scrape(door)
    assert value(idle, "vllm:num_requests_running") == value(idle, "vllm:num_requests_waiting") == 0
    errors: list[Exception] = []

    def one(i: int) -> None:
        try:
            api.completions.create(model="", prompt=PROMPT[:-1] + [100 + i], max_tokens=24,
                                   temperature=0.0, extra_body={"ignore_eos": True})
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    load = [threading.Thread(target=one, args=(i,)) for i in range(NUM_LOADED)]
    for thread in load:
        thread.start()
    seen = []
    while any(thread.is_alive() for thread in load):  # scrape as the endpoint picker does
        seen.append(scrape(door))
    for thread in load:
        thread.join()
    assert not errors
    assert max(value(s, "vllm:num_requests_waiting") for s in seen) > 0
    assert max(value(s, "vllm:num_requests_running") for s in seen) == 1  # max_running
    usage = [value(s, "vllm:kv_cache_usage_perc") for s in seen]
    assert all(0 <= u <= 1 for u in usage) and any(0 < u < 1 for u in usage)
    ((labels, one_value),) = scrape(door)["vllm:cache_config_info"]
    pool = door.worker.engine.pool
    assert one_value == 1
    assert (int(labels["block_size"]), int(labels["num_gpu_blocks"])) == (
        pool.block_size, pool.num_blocks // pool.num_layers)
