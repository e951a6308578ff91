"""Builders of random-weight Hugging Face models saved as checkpoint directories (tests only)."""

from __future__ import annotations

from pathlib import Path

import torch
from baton.model.config import ModelConfig

VARIANTS = {
    "llama2": {"architecture": "LlamaForCausalLM", "num_attention_heads": 4,
               "num_key_value_heads": 4},
    "llama3": {"architecture": "LlamaForCausalLM", "num_attention_heads": 4,
               "num_key_value_heads": 2,
               "rope": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "attention_bias": True, "num_attention_heads": 4,
              "num_key_value_heads": 1, "tie_word_embeddings": True},
    "mistral": {"architecture": "MistralForCausalLM", "num_attention_heads": 8,
                "num_key_value_heads": 2, "sliding_window": 4096},
}


def tiny_config(variant: str = "llama2", **overrides) -> ModelConfig:
    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5}
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    return ModelConfig(**fields)


def save_random_hf_model(config: ModelConfig, directory: Path, seed: int = 0):
    """Create a transformers model with random weights, save it, and return it (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # Non-trivial norms and biases so that a swapped weight shows up in the logits.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(directory)
    return model


# (variant, query heads, kv heads): GQA ratios 1, 2, 4 and MQA over every family.
EQUIVALENCE_CASES = [
    ("llama2", 4, 4), ("llama2", 4, 1),
    ("llama3", 8, 4), ("llama3", 8, 2),
    ("qwen2", 4, 2), ("qwen2", 4, 1),
    ("mistral", 8, 2), ("mistral", 8, 8),
]


def case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-h{case[1]}-kv{case[2]}"


def save_case(case: tuple[str, int, int], directory: Path, seed: int):
    """One equivalence case saved as a checkpoint; returns the transformers model (fp32)."""
    variant, heads, kv_heads = case
    config = tiny_config(variant, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return save_random_hf_model(config, directory, seed=seed)
