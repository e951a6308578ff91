"""Builders of random-weight Hugging Face models saved as checkpoint directories (tests only)."""

from __future__ import annotations

from pathlib import Path

import torch
from baton.kv import DenseKV, KVPool
from baton.model import decode_step, prefill
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
    # an explicit head_dim that is not hidden_size / heads, as Qwen3's checkpoints have
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qk_norm": True, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
              "rope": {"rope_type": "default", "rope_theta": 1000000.0}},
    # top-2 of 4 experts, renormalised, in every layer
    "mixtral": {"architecture": "MixtralForCausalLM", "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2},
    # top-2 of 6 narrower experts, not renormalised, and one dense layer between
    "qwen3_moe": {"architecture": "Qwen3MoeForCausalLM", "qk_norm": True, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "num_experts": 6,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": False,
                  "mlp_only_layers": [1]},
    # RoPE scalings over a Llama: the scenario's prompts (11 to 37 tokens) straddle YaRN's
    # original context of 16; dynamic NTK is exact up to max_position_embeddings, the longest
    # sequence served (baton.model.rope); LongRoPE's original context of 8 is shorter than
    # every prompt, so transformers, like baton on a 1024-token context, takes the long factors.
    "llama_yarn": {"architecture": "LlamaForCausalLM", "head_dim": 16,
                   "rope": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16}},
    "llama_dynamic": {"architecture": "LlamaForCausalLM", "head_dim": 16,
                      "max_position_embeddings": 48,
                      "rope": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}},
    "llama_longrope": {"architecture": "LlamaForCausalLM", "head_dim": 16,
                       "rope": {"rope_type": "longrope", "rope_theta": 10000.0,
                                "original_max_position_embeddings": 8,
                                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                "long_factor": [1.0, 1.5, 2.2, 3.4, 5.1, 7.7, 11.6, 17.4]}},
    # q/k/v and gate/up fused in the checkpoint, LongRoPE over half of each head (partial
    # rotary), and a sliding window shorter than the scenario's longer prompts
    "phi3": {"architecture": "Phi3ForCausalLM", "sliding_window": 20,
             "rope": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                      "original_max_position_embeddings": 8,
                      "short_factor": [1.0, 1.2, 1.7, 2.9], "long_factor": [1.0, 2.0, 4.5, 9.0]}},
    # Gemma: GELU-tanh MLP, sandwich norms, query_pre_attn_scalar other than head_dim, an
    # 8-token window on layers 0 and 2 (the prompts run past it), and caps small enough that
    # tanh bends the scores and logits of these random weights
    "gemma2": {"architecture": "Gemma2ForCausalLM", "head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.1,
               "final_logit_softcapping": 0.5, "sliding_window": 8, "tie_word_embeddings": True,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # Gemma 3: q/k norms, no soft-capping, the global layer's RoPE scaled and the sliding
    # layers' at a base of their own
    "gemma3": {"architecture": "Gemma3ForCausalLM", "head_dim": 16, "hidden_act": "gelu_pytorch_tanh",
               "qk_norm": True, "query_pre_attn_scalar": 24, "sliding_window": 8,
               "tie_word_embeddings": True,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "rope": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
               "rope_local": {"rope_type": "default", "rope_theta": 10000.0}},
}
GEMMA_VARIANTS = ("gemma2", "gemma3")


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
    # no padding id: some families' defaults (Phi-3's 32000) lie outside a tiny vocabulary
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict(), pad_token_id=None)
    # Gemma's soft-capping is transformers' eager attention's alone
    eager = {"attn_implementation": "eager"} if config.gemma_layout else {}
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **eager)
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


# (variant, query heads, kv heads): GQA ratios 1, 2, 4 and MQA over every family; head_dim
# 16 and 8 (torch's kernels), 32 and 64 (hidden 64 over 2 and 1 heads: baton's CPU kernels).
EQUIVALENCE_CASES = [
    ("llama2", 4, 4), ("llama2", 4, 1), ("llama2", 1, 1),
    ("llama3", 2, 1),
    ("llama3", 8, 4), ("llama3", 8, 2),
    ("qwen2", 4, 2), ("qwen2", 4, 1),
    ("mistral", 8, 2), ("mistral", 8, 8),
    ("qwen3", 4, 2), ("qwen3", 8, 1),
    ("mixtral", 4, 2), ("qwen3_moe", 4, 2),
    ("llama_yarn", 4, 2), ("llama_dynamic", 4, 1), ("llama_longrope", 4, 2),
    ("phi3", 4, 2), ("phi3", 4, 4),
    ("gemma2", 4, 2), ("gemma2", 4, 1), ("gemma3", 4, 2), ("gemma3", 2, 2),
]


# Reduced precision is compared with fp32 on the dense families only: a token whose router
# scores two experts nearly alike may pick the other expert in bf16, in transformers as here,
# and which tokens do depends on each runtime's rounding, so the largest logit difference
# says nothing about the arithmetic (fp32 equality covers the experts).
MOE_VARIANTS = ("mixtral", "qwen3_moe")
REDUCED_PRECISION_CASES = [case for case in EQUIVALENCE_CASES if case[0] not in MOE_VARIANTS]


def case_id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-h{case[1]}-kv{case[2]}"


def save_case(case: tuple[str, int, int], directory: Path, seed: int):
    """One equivalence case saved as a checkpoint; returns the transformers model (fp32)."""
    variant, heads, kv_heads = case
    config = tiny_config(variant, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return save_random_hf_model(config, directory, seed=seed)


# --- One scenario run by both runtimes, at any device and precision -------------------------


def run_scenario(ours, token_sequences) -> list[torch.Tensor]:
    """Our logits for: a full prefill of sequence 0; two-slice prefills of sequences 1 and 2
    over a paged cache; then 8 batched decode steps that feed the tokens given in the
    sequences (so that every runtime and precision follows the same path)."""
    device, dtype = ours.model.device, ours.model.dtype
    config = ours.config
    first = token_sequences[0]
    outputs = [prefill(ours.model, first.to(device), torch.arange(len(first), device=device),
                       DenseKV(config.num_hidden_layers))]
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=4, num_blocks=256, dtype=dtype, device=device)
    kvs = [pool.view("a"), pool.view("b")]
    prompts = [seq[:-8] for seq in token_sequences[1:]]
    for ids, kv in zip(prompts, kvs, strict=True):
        ids = ids.to(device)
        cut = len(ids) // 2 + 1
        prefill(ours.model, ids[:cut], torch.arange(cut, device=device), kv, want_logits=False)
        outputs.append(prefill(ours.model, ids[cut:], torch.arange(cut, len(ids), device=device), kv))
    for step in range(8):  # step s feeds the sequence's token at position len(prompt) + s
        tokens = torch.stack([seq[len(p) + step] for seq, p in zip(token_sequences[1:], prompts)])
        positions = torch.tensor([len(p) + step for p in prompts], device=device)
        outputs.extend(decode_step(ours.model, tokens.to(device), positions, kvs))
    return [o.float().cpu() for o in outputs]


def reference_logits(hf_model, token_sequences) -> list[torch.Tensor]:
    """transformers' logits at the same points as ``run_scenario``."""
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        full = [hf_model(seq[None].to(device)).logits[0].float().cpu() for seq in token_sequences]
    outputs = [full[0][-1]]
    prompt_lengths = [len(seq) - 8 for seq in token_sequences[1:]]
    outputs += [full[i + 1][n - 1] for i, n in enumerate(prompt_lengths)]
    for step in range(8):
        outputs += [full[i + 1][n + step] for i, n in enumerate(prompt_lengths)]
    return outputs


def sequences(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab_size, (n,), generator=generator) for n in (37, 29 + 8, 11 + 8)]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
