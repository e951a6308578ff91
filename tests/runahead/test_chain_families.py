"""A KV-Runahead chain of each newer family equals one process: Phi-3's fused checkpoint
tensors, partial LongRoPE and sliding window, and Gemma's sandwich norms, soft-capping and
alternating sliding and global layers, with prompts longer than the windows."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV
from baton.model import prefill, save_checkpoint
from baton.model.presets import random_model
from baton.runahead import LocalChain, ModelSource
from hf_reference import tiny_config

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.mark.parametrize("variant", ["phi3", "gemma2", "gemma3"])
def test_a_chain_of_a_newer_family_equals_single_process_prefill(tmp_path, variant):
    config = tiny_config(variant)
    model = random_model(config, seed=5)
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    token_ids = torch.randint(0, config.vocab_size, (45,), generator=torch.Generator().manual_seed(5))
    kv = DenseKV(config.num_hidden_layers)
    logits = prefill(model, token_ids, torch.arange(45), kv)
    with LocalChain(ModelSource(path=str(tmp_path), dtype="float32"), 2, timeout_s=20) as chain:
        result = chain.prefill(token_ids, [0, 26, 45])
    assert (result.first_token_logits - logits).abs().max() < TOLERANCE
    for got, want in zip(result.layers, kv.complete_layers(), strict=True):
        assert (got.k - want.k).abs().max() < TOLERANCE and (got.v - want.v).abs().max() < TOLERANCE
