"""Greedy continuation through the runtime's own prefill / decode entry points.

The trainer prints one at every evaluation so a run can be judged by eye, and
the shipped model's test checks that what it writes is Python.
"""

from __future__ import annotations

import torch

from baton.kv.dense import DenseKV
from baton.model.llama import CausalLM, decode_step, prefill
from baton.model.tokenizer import Tokenizer


def greedy_continuation(model: CausalLM, tokenizer: Tokenizer, prompt: str, max_tokens: int) -> str:
    """The text the model writes after ``prompt`` (argmax each step; stops at eos)."""
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("prompt encodes to no tokens")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} exceeds "
                         f"the model's context of {limit}")
    eos = set(model.config.eos_token_ids)
    kv = DenseKV(model.config.num_hidden_layers)
    ids = torch.tensor(prompt_ids, device=model.device)
    logits = prefill(model, ids, torch.arange(len(prompt_ids), device=model.device), kv)
    generated: list[int] = []
    for position in range(len(prompt_ids), len(prompt_ids) + max_tokens):
        token = int(logits.argmax())
        if token in eos:
            break
        generated.append(token)
        step = torch.tensor([token], device=model.device)
        logits = decode_step(model, step, torch.tensor([position], device=model.device), [kv])[0]
    return tokenizer.decode(generated)
