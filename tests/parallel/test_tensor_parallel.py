"""Tensor parallelism on the CPU over gloo: a group of two ranks gives what one process gives,
on every family baton loads (fp32, greedy), through the engine (chunked prefills mixed with
decodes, a paged pool) and through a plain prefill over a dense cache; with PyramidInfer on,
the group keeps the very tokens one process keeps, in the prompt and while generating; and a
KV-Runahead chain of two ranks that are each a group of two equals one process, its cache
decoded by a group or by one process alike."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from baton.config import KVPoolConfig, PyramidConfig, SchedulerConfig
from baton.kv import DenseKV
from baton.model import prefill
from baton.model.loader import load_checkpoint, save_checkpoint
from baton.model.presets import random_model
from baton.model.sharding import ShardLayout, check_divisible
from baton.parallel.leader import start_group
from baton.pyramid.engine_hook import engine_compressor_factory
from baton.pyramid.prefill import compressor_factory
from baton.runahead.errors import ChainError
from baton.runahead.local import LocalChain
from baton.runahead.request import ModelSource
from baton.sampling.params import SamplingParams
from baton.sarathi.engine import Engine
from hf_reference import tiny_config

# (variant, query heads, kv heads, overrides): every family; KV heads split (kv >= 2) and
# replicated (kv 1 over 2 ranks); a vocabulary the group does not divide (padded shards)
CASES = [
    ("llama2", 4, 4, {}), ("llama3", 4, 1, {"vocab_size": 255}), ("mistral", 8, 2, {}),
    ("qwen2", 4, 2, {}), ("qwen3", 4, 2, {}), ("mixtral", 4, 2, {}), ("qwen3_moe", 4, 2, {}),
    ("phi3", 4, 2, {}), ("gemma2", 4, 2, {}), ("gemma3", 4, 1, {}),
]
SCHEDULER = SchedulerConfig(token_budget=24)  # prompts prefill in chunks beside decodes
KV = KVPoolConfig(block_size=4, num_blocks=512)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def followers_of(pid: int) -> list[int]:
    """The tensor-parallel followers a process started."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children
            if b"baton.parallel.follower" in Path(f"/proc/{child}/cmdline").read_bytes()]


def save_model(config, directory) -> None:
    """Random weights decisive enough (std 0.1) that no greedy choice is a near tie."""
    model = random_model(config, seed=3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.mul_(5.0)
    save_checkpoint(model, directory, dtype=torch.float32)


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (7, 41, 23)]


def run(loaded, token_lists):
    """(the engine's tokens per prompt, the logits of a dense prefill of the longest)."""
    engine = Engine(loaded.model, None, scheduler=SCHEDULER, kv=KV)
    tokens = [result.token_ids for result in engine.generate(token_lists, PARAMS)]
    ids = torch.tensor(token_lists[1])
    logits = prefill(loaded.model, ids, torch.arange(len(ids)),
                     DenseKV(loaded.config.num_hidden_layers))
    return tokens, logits


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-h{case[1]}-kv{case[2]}")
def test_two_ranks_equal_one_process(case, tmp_path):
    variant, heads, kv_heads, overrides = case
    config = tiny_config(variant, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         **overrides)
    save_model(config, tmp_path)
    token_lists = prompts(config.vocab_size)
    single = load_checkpoint(str(tmp_path), "float32", "cpu", with_tokenizer=False)
    want_tokens, want_logits = run(single, token_lists)
    loaded, followers = start_group(2, str(tmp_path), "float32", "cpu", timeout_s=60.0,
                                    with_tokenizer=False)
    try:
        assert loaded.model.layout.size == 2
        got_tokens, got_logits = run(loaded, token_lists)
        assert followers.alive()
    finally:
        followers.close()
    assert got_tokens == want_tokens
    assert got_logits.shape == want_logits.shape == (config.vocab_size,)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_a_rank_holds_its_share_of_the_weights():
    config = tiny_config("llama3", num_attention_heads=8, num_key_value_heads=2, vocab_size=255)
    layout = ShardLayout(config, size=2, rank=1)
    q = torch.arange(8 * 8 * 4, dtype=torch.float32).view(8 * 8, 4)  # 8 heads of 8
    assert torch.equal(layout.shard("model.layers.0.self_attn.q_proj.weight", q), q[32:])
    k = torch.arange(2 * 8 * 4, dtype=torch.float32).view(2 * 8, 4)
    assert torch.equal(layout.shard("model.layers.0.self_attn.k_proj.weight", k), k[8:])
    o = torch.arange(4 * 64, dtype=torch.float32).view(4, 64)
    assert torch.equal(layout.shard("model.layers.0.self_attn.o_proj.weight", o), o[:, 32:])
    down = torch.arange(4 * 160, dtype=torch.float32).view(4, 160)
    assert torch.equal(layout.shard("model.layers.0.mlp.down_proj.weight", down), down[:, 80:])
    embed = torch.ones(255, 3)
    shard = layout.shard("model.embed_tokens.weight", embed)
    assert shard.shape == (128, 3) and shard[:127].eq(1).all() and shard[127].eq(0).all()
    norm = torch.ones(64)
    assert layout.shard("model.layers.0.input_layernorm.weight", norm) is norm
    # one KV head over 4 ranks: ranks 0-3 all read head 0, of 4 query heads over 4 ranks
    mqa = ShardLayout(tiny_config("llama2", num_key_value_heads=1), size=4, rank=3)
    assert (mqa.num_heads, mqa.num_kv_heads, mqa.first_kv_head) == (1, 1, 0)


def test_a_size_that_does_not_divide_the_model_is_refused():
    with pytest.raises(ValueError, match="num_attention_heads 4"):
        check_divisible(tiny_config("llama2"), 3)
    with pytest.raises(ValueError, match="num_key_value_heads 3"):
        check_divisible(tiny_config("llama2", num_attention_heads=6, num_key_value_heads=3), 2)


# small enough that the test's prompts are pruned, and a generation's batches too
PYRAMID = PyramidConfig(keep_ratio=0.5, min_context=8, num_sinks=2, generation_update_every=4)
COMPRESSED_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def kept_positions(loaded, token_lists) -> tuple[list[list[int]], list]:
    """(tokens per prompt, after every step: each live sequence's kept positions per layer)."""
    engine = Engine(loaded.model, None, scheduler=SCHEDULER, kv=KV,
                    compressor_factory=engine_compressor_factory(PYRAMID, loaded.config))
    ids = [engine.add_request(prompt, COMPRESSED_PARAMS) for prompt in token_lists]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    history = []
    while engine.has_work():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        pool = engine.pool
        history.append({seq: [pool.gather(seq, layer).positions.tolist()
                              for layer in range(pool.num_layers)]
                        for seq in sorted(pool.sequence_ids())})
    return [tokens[request_id] for request_id in ids], history


@pytest.mark.parametrize("variant", ["llama3", "qwen3"])
def test_two_ranks_keep_what_one_process_keeps(variant, tmp_path):
    config = tiny_config(variant, num_attention_heads=4, num_key_value_heads=2)
    save_model(config, tmp_path)
    token_lists = prompts(config.vocab_size)
    single = load_checkpoint(str(tmp_path), "float32", "cpu", with_tokenizer=False)
    want_tokens, want_kept = kept_positions(single, token_lists)
    loaded, followers = start_group(2, str(tmp_path), "float32", "cpu", timeout_s=60.0,
                                    with_tokenizer=False)
    try:
        got_tokens, got_kept = kept_positions(loaded, token_lists)
    finally:
        followers.close()
    assert got_tokens == want_tokens
    # something was pruned, in the prompt and while generating, and the same everywhere
    lengths = [len(layer) for step in want_kept for layers in step.values() for layer in layers]
    assert min(lengths) < max(lengths)
    assert got_kept == want_kept


@pytest.mark.parametrize("compressed", [False, True], ids=["full", "compressed"])
def test_a_chain_of_two_groups_equals_one_process(compressed, tmp_path):
    config = tiny_config("llama3", num_attention_heads=4, num_key_value_heads=2)
    save_model(config, tmp_path)
    prompt = prompts(config.vocab_size)[1]  # 41 tokens over two chain ranks
    single = load_checkpoint(str(tmp_path), "float32", "cpu", with_tokenizer=False)
    make_observer = compressor_factory(PYRAMID, config) if compressed else None
    observer = make_observer(len(prompt)) if compressed else None
    kv = DenseKV(config.num_hidden_layers)
    want_logits = prefill(single.model, torch.tensor(prompt), torch.arange(len(prompt)), kv,
                          observer=observer)
    want_layers = observer.compress(kv.complete_layers()) if compressed else kv.complete_layers()
    with LocalChain(ModelSource(path=str(tmp_path), dtype="float32"), 2, timeout_s=60,
                    make_observer=make_observer, tensor_parallel_size=2) as chain:
        result = chain.prefill(torch.tensor(prompt))
        if not compressed:  # a rank's follower dies: its chain says so, and fast
            (follower,) = followers_of(chain.processes[1].pid)
            os.kill(follower, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(ChainError, match="tensor-parallel group is down"):
                chain.prefill(torch.tensor(prompt))
            assert time.monotonic() - started < 30
    torch.testing.assert_close(result.first_token_logits, want_logits, rtol=1e-4, atol=1e-4)
    for got, want in zip(result.layers, want_layers, strict=True):
        assert torch.equal(got.positions, want.positions)  # the same tokens kept
        torch.testing.assert_close(got.k, want.k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.v, want.v, rtol=1e-4, atol=1e-4)
    # the chain's cache (every head) decoded by one process and by a group of two alike
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    decoded = []
    loaded, followers = start_group(2, str(tmp_path), "float32", "cpu", timeout_s=60.0,
                                    with_tokenizer=False)
    try:
        for model in (single.model, loaded.model):
            engine = Engine(model, None, scheduler=SCHEDULER, kv=KV)
            request = engine.add_prefilled_request(prompt, result.layers, result.first_token_logits,
                                                   params)
            outputs = [output for _ in range(64) if engine.has_work() for output in engine.step()]
            decoded.append([t for output in outputs if output.request_id == request
                            for t in output.new_token_ids])
    finally:
        followers.close()
    assert decoded[0] == decoded[1] and len(decoded[0]) == 8
