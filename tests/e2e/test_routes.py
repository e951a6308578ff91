"""One request, one answer: the same request pinned to the chain, pinned to the decode pod,
and run in this process by the engine gives the same tokens and the same accounting, with
compression off or on at any keep ratio, with stop strings, and sampled with a seed; the
route it took is named on its last message, with the reason."""

from __future__ import annotations

import dataclasses

import pytest
from baton.api.requests import CompressionParams, GenerateRequest
from baton.config import ChainConfig, KVPoolConfig, PyramidConfig
from baton.dtypes import DTYPES
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.loader import load_checkpoint
from baton.pyramid.engine_hook import engine_compressor_factory
from baton.routing.redis_store import RedisStore
from baton.runahead.break_even import Link, kv_bytes_per_token
from baton.runahead.request import ModelSource
from baton.runahead.table import PartitionTable
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, long_prompt_ids

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    """The shipped model in this process with the deployment's compression settings (the
    cluster's pods run PyramidConfig's defaults)."""
    loaded = load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")
    return Engine(loaded.model, loaded.tokenizer, kv=KVPoolConfig(num_blocks=512),
                  compressor_factory=engine_compressor_factory(PyramidConfig(), loaded.config))


@pytest.fixture(scope="module")
def prompt(reference):
    return tuple(long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 172))


COMPRESSIONS = {"off": CompressionParams(enabled=False), "keep 1.0": CompressionParams(keep_ratio=1.0),
                "keep 0.7": CompressionParams(keep_ratio=0.7), "keep 0.5": CompressionParams(keep_ratio=0.5)}
SAMPLINGS = {"greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
             "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=MAX_TOKENS)}


def run_everywhere(client, engine, prompt, sampling, compression):
    """(tokens, last step) per route: chain, local, and in-process (tokens only)."""
    answers = {}
    for route in ("chain", "local"):
        completion = client.generate(GenerateRequest(token_ids=prompt, sampling=sampling,
                                                     compression=compression, prefill_route=route))
        answers[route] = (completion.token_ids, completion.last)
    params = dataclasses.replace(sampling, compression=compression)
    answers["in-process"] = (engine.generate([list(prompt)], params)[0].token_ids, None)
    return answers


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("compression_name", list(COMPRESSIONS))
def test_every_route_gives_the_same_tokens_and_accounting(client, engine, prompt, compression_name,
                                                          sampling_name):
    answers = run_everywhere(client, engine, prompt, SAMPLINGS[sampling_name],
                             COMPRESSIONS[compression_name])
    tokens = {route: answer[0] for route, answer in answers.items()}
    assert tokens["chain"] == tokens["local"] == tokens["in-process"], tokens
    chain, local = answers["chain"][1], answers["local"][1]
    assert chain.route.chain_id and not local.route.chain_id
    assert "prefill_route chain" in chain.route.reason and "prefill_route local" in local.route.reason
    for field in ("prompt_tokens", "completion_tokens", "kv_tokens_kept", "kv_tokens_full"):
        assert getattr(chain.usage, field) == getattr(local.usage, field), field
    assert chain.usage.kv_tokens_full == len(prompt) * 4  # the shipped model's layers
    if compression_name in ("off", "keep 1.0"):
        assert chain.usage.kv_tokens_kept == chain.usage.kv_tokens_full
    else:
        assert chain.usage.kv_tokens_kept < chain.usage.kv_tokens_full
    assert chain.usage.kv_bytes_shipped > 0 and local.usage.kv_bytes_shipped == 0


def test_stop_strings_end_every_route_at_the_same_place(client, engine, prompt):
    greedy = SAMPLINGS["greedy"]
    text = client.generate(GenerateRequest(token_ids=prompt, sampling=greedy)).text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    sampling = dataclasses.replace(greedy, stop=[stop])
    answers = {}
    for route in ("chain", "local"):
        completion = client.generate(GenerateRequest(token_ids=prompt, sampling=sampling,
                                                     prefill_route=route))
        usage = completion.last.usage
        answers[route] = (completion.text, completion.last.finish_reason, usage.prompt_tokens,
                          usage.completion_tokens, usage.kv_tokens_kept, usage.kv_tokens_full)
    assert answers["chain"] == answers["local"]
    assert answers["chain"][0] == text[:text.index(stop)]


def test_the_automatic_route_says_why(client, prompt):
    fresh = list(reversed(prompt))  # as long, and in no decode pod's prefix cache yet
    whole = CompressionParams(enabled=False)  # a pruned cache is private to its request
    long = client.generate(GenerateRequest(token_ids=fresh, sampling=SAMPLINGS["greedy"],
                                           compression=whole)).last
    short = client.generate(GenerateRequest(token_ids=prompt[:10], sampling=SAMPLINGS["greedy"])).last
    assert long.route.chain_id and f">= prefill_threshold_tokens {CHAIN_THRESHOLD_TOKENS}" in long.route.reason
    assert not short.route.chain_id and "< prefill_threshold_tokens" in short.route.reason
    # The chain's KV (compression off here) is cached on its decode pod like any other: the
    # same prompt again is prefilled there, only its last block, and the reason names the hit.
    again = client.generate(GenerateRequest(token_ids=fresh, sampling=SAMPLINGS["greedy"],
                                            compression=whole))
    assert not again.last.route.chain_id and "prompt tokens cached on" in again.last.route.reason
    assert again.last.usage.cached_prompt_tokens >= len(fresh) - 2 * 16
    assert again.token_ids == client.generate(GenerateRequest(
        token_ids=fresh, sampling=SAMPLINGS["greedy"], compression=whole,
        prefill_route="chain")).token_ids


def test_the_pods_advertise_what_routing_matches_them_by(cluster):
    # The chain's break-even by the route rule: the shipped table it runs on the CPU, its KV
    # (compressed by default) over the configured link (this cluster's gateway ignores it,
    # chain_break_even false, so these tests can send the chain short prompts); and every
    # pod's KV dtype: a decode pod takes a chain's cache only of its own.
    store = RedisStore(cluster.redis_url)
    try:
        (head,) = [w for w in store.list_workers("prefill") if w.rank == 0]
        pods = store.list_workers("decode")
    finally:
        store.close()
    model = ModelSource(path=str(SHIPPED_MODEL_DIR)).config()
    chain, pyramid = ChainConfig(), PyramidConfig()
    kv_per_token = kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads,
                                      model.head_dim, DTYPES[head.kv_dtype].itemsize,
                                      pyramid.keep_ratio)
    link = Link(chain.kv_link_gb_per_s * 1e9, chain.extra_hop_ms / 1e3)
    assert head.break_even_tokens == PartitionTable.load().break_even(2, "cpu", kv_per_token, link)
    assert head.break_even_tokens > 0
    assert {pod.kv_dtype for pod in pods} == {head.kv_dtype} and head.kv_dtype in ("float32", "bfloat16")
