"""Greedy generation on the shipped model with an fp8 KV cache, against the full-precision
cache, measured (docs/benchmarks/fp8-kv.md); the prefix cache serves fp8 blocks as it serves
any."""

from __future__ import annotations

import functools

import pytest
from baton.config import KVCacheConfig, KVPoolConfig
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.loader import load_checkpoint
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine

PROMPTS = ["The little robot wanted to", "Once upon a time, in a quiet village,",
           "She opened the box and found"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@functools.cache
def shipped():
    return load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")


def generate(cache_dtype: str, prompts=PROMPTS, prefix_cache: bool = False):
    loaded = shipped()
    engine = Engine(loaded.model, loaded.tokenizer,
                    kv=KVPoolConfig(num_blocks=512, prefix_cache=prefix_cache),
                    kv_cache=KVCacheConfig(dtype=cache_dtype))
    return engine, [result.token_ids for result in engine.generate(prompts, GREEDY)]


# The least share of the greedy tokens that must agree before the first that differs: e5m2's
# two mantissa bits keep less (0.68 on these prompts on an AVX2 host, 0.28 on the benchmark's),
# and a broken cache agrees on next to nothing.
AGREEMENT_FLOOR = {"fp8_e4m3": 0.5, "fp8_e5m2": 0.25}


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_greedy_tokens_mostly_agree_with_the_full_precision_cache(cache_dtype):
    _, full = generate("auto")
    engine, fp8 = generate(cache_dtype)
    assert engine.pool.k_cache.element_size() == 1
    # Agreement up to the first token that differs (after it, the texts diverge by design).
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(full, fp8)]
    assert sum(agreed) >= AGREEMENT_FLOOR[cache_dtype] * sum(len(x) for x in full), (agreed, cache_dtype)


def test_the_prefix_cache_serves_fp8_blocks():
    prompt = PROMPTS[1] * 6  # several full blocks
    engine, first = generate("fp8_e4m3", [prompt], prefix_cache=True)
    again = engine.generate([prompt], GREEDY)[0]
    assert engine.pool.prefix_cache.stats.hits >= 1
    assert again.token_ids == first[0]  # the cached fp8 blocks are the bytes computed before
    _, without = generate("fp8_e4m3", [prompt])
    assert without == first
