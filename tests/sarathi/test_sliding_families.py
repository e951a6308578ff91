"""Families with sliding windows per layer or per model (Gemma 2, Gemma 3, Phi-3) through the
SARATHI engine: a prompt fed in chunks gives its whole prefill's logits, and greedy generation
of prompts batched in a small token budget, decoding well past the window, picks
transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV, KVPool
from baton.model import load_checkpoint, prefill
from baton.sampling.params import SamplingParams
from baton.sarathi.request import Sequence
from baton.sarathi.runner import ModelRunner
from baton.sarathi.scheduler import PrefillChunk, SchedulerOutput
from engine_fixtures import make_engine, prompts_of_lengths
from hf_reference import save_random_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "phi3"])
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config = tiny_config(request.param, num_attention_heads=4, num_key_value_heads=2)
    hf_model = save_random_hf_model(config, directory, seed=3)
    return hf_model, load_checkpoint(directory, dtype="float32", device="cpu",
                                     with_tokenizer=False).model


def chunked_logits(model, prompt: list[int], chunk_size: int) -> torch.Tensor:
    config = model.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=4, num_blocks=64)
    runner = ModelRunner(model, pool)
    seq = Sequence("s", prompt, GREEDY, arrival=0, sampler=None, decoder=None, stop_matcher=None)
    logits = None
    while seq.num_computed < len(prompt):
        chunk = PrefillChunk(seq, min(chunk_size, len(prompt) - seq.num_computed))
        _, logits = runner.execute(SchedulerOutput(prefills=[chunk]))
        seq.num_computed += chunk.num_tokens
    return logits.logits[0]


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_prefill_equals_the_whole_prefill_past_the_window(pair, chunk_size):
    _, model = pair
    (prompt,) = prompts_of_lengths(45)
    whole = prefill(model, torch.tensor(prompt), torch.arange(45), DenseKV(model.config.num_hidden_layers))
    torch.testing.assert_close(chunked_logits(model, prompt, chunk_size), whole, atol=1e-5, rtol=1e-5)


def test_greedy_generation_picks_transformers_tokens(pair):
    hf_model, model = pair
    prompts = prompts_of_lengths(9, 23, 41)  # all past Phi-3's original RoPE context of 8
    results = make_engine(model, token_budget=16).generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        sequence = list(prompt)
        for _ in range(GREEDY.max_tokens):
            with torch.no_grad():
                sequence.append(int(hf_model(torch.tensor([sequence])).logits[0, -1].argmax()))
        assert result.token_ids == sequence[len(prompt):]
