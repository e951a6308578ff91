"""Random-weight models drawn where they live (``draw_on_device``: the GPU benchmarks' 1B
model) are whole models: every weight drawn or set, ties kept, RoPE's frequencies right,
the same seed the same weights, and they survive a Hugging Face checkpoint."""

from __future__ import annotations

import torch
from baton.kv import DenseKV
from baton.model import load_checkpoint, prefill, save_checkpoint
from baton.model.presets import PRESETS, random_model
from baton.model.rope import inverse_frequencies
from hf_reference import tiny_config


def test_a_model_drawn_on_its_device_is_complete_and_deterministic(tmp_path):
    config = tiny_config("llama3", tie_word_embeddings=True)
    model = random_model(config, seed=3, draw_on_device=True)
    again = random_model(config, seed=3, draw_on_device=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.rotary.inv_freq, inverse_frequencies(config))
    for (name, weight), (_, same) in zip(model.state_dict().items(), again.state_dict().items(),
                                         strict=True):
        assert torch.equal(weight, same), name
        if name.endswith("norm.weight"):
            assert bool((weight == 1).all()), name
        elif name.endswith("weight"):
            assert 0.015 < weight.std().item() < 0.025, name
    tokens = torch.arange(12) * 7
    logits = prefill(model, tokens, torch.arange(12), DenseKV(config.num_hidden_layers))
    assert bool(torch.isfinite(logits).all())
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    loaded = load_checkpoint(tmp_path, dtype="float32", with_tokenizer=False).model
    torch.testing.assert_close(prefill(loaded, tokens, torch.arange(12),
                                       DenseKV(config.num_hidden_layers)), logits)


def test_the_1b_preset_has_llama_3_2_1b_shape():
    model_config = PRESETS["random-1b"]
    with torch.device("meta"):
        from baton.model import CausalLM

        model = CausalLM(model_config)
    assert 1.23e9 < sum(p.numel() for p in model.parameters()) < 1.24e9


def test_rope_frequencies_stay_exact_fp32_whatever_dtype_the_model_is_cast_to(tmp_path):
    # rounded to bf16, a frequency near 1 would turn position 1000's angle by ~2 radians
    config = tiny_config("llama3")
    exact = inverse_frequencies(config)
    bf16 = random_model(config, dtype=torch.bfloat16)
    assert bf16.rotary.inv_freq.dtype == torch.float32 and torch.equal(bf16.rotary.inv_freq, exact)
    save_checkpoint(bf16, tmp_path, dtype=torch.bfloat16)
    loaded = load_checkpoint(tmp_path, dtype="bfloat16", with_tokenizer=False).model
    assert torch.equal(loaded.rotary.inv_freq, exact)
    # the same model computes the same thing made either way
    tokens = torch.arange(40) * 5
    positions = torch.arange(1000, 1040)
    assert torch.equal(prefill(bf16, tokens, positions, DenseKV(config.num_hidden_layers)),
                       prefill(loaded, tokens, positions, DenseKV(config.num_hidden_layers)))
