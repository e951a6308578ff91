"""A tiny random model and engines over it for the SARATHI tests (built in milliseconds)."""

from __future__ import annotations

import torch
from baton.config import KVPoolConfig, SchedulerConfig
from baton.model import CausalLM
from baton.sarathi import Engine
from hf_reference import tiny_config


def build_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    # head_dim 32: the size baton's CPU attention kernels take, so the exactness tests cover them
    config = tiny_config("llama3", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                         head_dim=32)
    return CausalLM(config).eval()


def make_engine(model: CausalLM, policy: str = "sarathi", token_budget: int = 32, num_blocks: int = 512,
                block_size: int = 4, max_running: int = 16, prefix_cache: bool = True,
                **engine_kwargs) -> Engine:
    return Engine(model, None, scheduler=SchedulerConfig(policy=policy, token_budget=token_budget,
                                                         max_running=max_running),
                  kv=KVPoolConfig(block_size=block_size, num_blocks=num_blocks,
                                  prefix_cache=prefix_cache), **engine_kwargs)


def prompts_of_lengths(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
