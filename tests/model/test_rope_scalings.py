"""RoPE scalings (YaRN, dynamic NTK, LongRoPE) against transformers: the frequencies and
cos/sin factors bit for bit, and greedy decoding over a paged cache token for token, on both
sides of each scaling's threshold that baton serves (baton.model.rope says which)."""

from __future__ import annotations

import pytest
import torch
from baton.kv import KVPool
from baton.model import decode_step, load_checkpoint, prefill
from baton.model.rope import rope_frequencies
from hf_reference import save_random_hf_model, tiny_config

TOLERANCE = 1e-4

FREQUENCY_CASES = {
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16},
    "yarn-untruncated-betas": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                               "original_max_position_embeddings": 128, "beta_fast": 16,
                               "beta_slow": 2, "truncate": False},
    "yarn-deepseek-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 64, "mscale": 0.707,
                             "mscale_all_dim": 0.707},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                              "original_max_position_embeddings": 256, "attention_factor": 0.8},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0},
    "longrope": tiny_config("llama_longrope").rope,
    "longrope-factor": {**tiny_config("llama_longrope").rope, "factor": 16.0},
}


@pytest.mark.parametrize("case", sorted(FREQUENCY_CASES))
def test_frequencies_and_attention_factor_equal_transformers(case):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config("llama_longrope", max_position_embeddings=1000, rope=dict(FREQUENCY_CASES[case]))
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    # at a sequence of 1000 tokens, the context served: LongRoPE's long factors, and dynamic
    # NTK's frequencies before any rescaling
    rope_type = config.rope["rope_type"]
    want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), seq_len=1000)
    got, got_factor = rope_frequencies(config, config.rope)
    assert torch.equal(got, want)
    assert got_factor == want_factor


def greedy_against_transformers(hf_model, ours, prompt: torch.Tensor, steps: int) -> None:
    """Greedy decoding over a paged cache (the prompt in two slices, then ``steps`` tokens):
    every step's logits within TOLERANCE of transformers' on the whole sequence so far, and
    the same token chosen."""
    config = ours.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=4, num_blocks=64)
    kv = pool.view("s")
    cut = len(prompt) // 2
    prefill(ours.model, prompt[:cut], torch.arange(cut), kv, want_logits=False)
    logits = prefill(ours.model, prompt[cut:], torch.arange(cut, len(prompt)), kv)
    sequence = prompt.tolist()
    for step in range(steps + 1):
        with torch.no_grad():
            reference = hf_model(torch.tensor([sequence])).logits[0, -1].float()
        assert (logits - reference).abs().max() < TOLERANCE
        token = int(logits.argmax())
        assert token == int(reference.argmax())
        sequence.append(token)
        if step < steps:
            logits = decode_step(ours.model, torch.tensor([token]), torch.tensor([len(sequence) - 1]),
                                 [kv])[0]


def checkpoint(variant: str, directory, **overrides):
    config = tiny_config(variant, num_attention_heads=4, num_key_value_heads=2, **overrides)
    return save_random_hf_model(config, directory, seed=7)


def prompt_of(length: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))


def test_yarn_decodes_greedily_as_transformers_across_the_original_context(tmp_path):
    hf_model = checkpoint("llama_yarn", tmp_path)
    ours = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
    greedy_against_transformers(hf_model, ours, prompt_of(10), steps=12)  # 10 -> 22, past 16
    greedy_against_transformers(hf_model, ours, prompt_of(30), steps=3)


def test_dynamic_ntk_is_exact_up_to_the_longest_sequence_served(tmp_path):
    hf_model = checkpoint("llama_dynamic", tmp_path)
    ours = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
    greedy_against_transformers(hf_model, ours, prompt_of(40), steps=7)  # ends at 48, the limit


def test_longrope_takes_the_short_factors_when_served_within_the_original_context(tmp_path):
    hf_model = checkpoint("llama_longrope", tmp_path)
    short = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False,
                            max_model_len=8)
    greedy_against_transformers(hf_model, short, prompt_of(5), steps=2)  # 8 tokens: short factors
    long = load_checkpoint(tmp_path, dtype="float32", device="cpu", with_tokenizer=False)
    greedy_against_transformers(hf_model, long, prompt_of(9), steps=4)  # past 8: long factors
