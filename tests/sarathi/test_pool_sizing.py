"""The KV pool sized to the machine: a share of the memory free after the weights, a cap on
the context (model.max_model_len), and a decode pod that refuses to start when one sequence
of that length cannot fit, saying how many tokens would."""

from __future__ import annotations

import pytest
import torch
from baton.config import KVPoolConfig
from baton.decode.server import check_pool_holds_a_sequence
from baton.device_memory import free_memory_bytes
from baton.model.presets import random_model
from baton.sarathi import Engine
from baton.sarathi.memory import build_pool
from hf_reference import tiny_config


def test_a_share_of_the_free_memory_sizes_the_pool():
    config = tiny_config("llama3")
    free = free_memory_bytes(torch.device("cpu"))
    pool = build_pool(config, KVPoolConfig(memory_fraction=0.001), torch.float32)
    expected = int(0.001 * free) // pool.bytes_per_block
    assert abs(pool.num_blocks - expected) <= expected // 20 + 1  # free memory moves a little
    assert build_pool(config, KVPoolConfig(memory_mib=4), torch.float32).num_blocks == \
        4 * 2**20 // pool.bytes_per_block


def test_max_model_len_caps_the_context_and_a_pool_too_small_for_it_refuses_to_start():
    config = tiny_config("llama3")  # 1024 positions
    config.cap_context(256)
    assert config.max_position_embeddings == 256
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's max_position_embeddings 256"):
        config.cap_context(4096)
    model = random_model(config)
    small = Engine(model, None, kv=KVPoolConfig(num_blocks=3 * 8, block_size=16))  # 128 tokens
    with pytest.raises(ValueError, match="holds 128 tokens of one sequence, fewer than max_model_len 256"):
        check_pool_holds_a_sequence(small)
    check_pool_holds_a_sequence(small, explicit_blocks=True)  # a pool sized by hand: a warning
    check_pool_holds_a_sequence(Engine(model, None, kv=KVPoolConfig(num_blocks=3 * 16, block_size=16)))
