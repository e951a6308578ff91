"""Our logits equal Hugging Face transformers on the same random weights (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV, KVPool
from baton.model import decode_step, load_checkpoint, prefill
from hf_reference import save_random_hf_model, tiny_config

TOLERANCE = 1e-4
# (variant, query heads, kv heads): GQA ratios 1, 2, 4 and MQA over every family.
CASES = [
    ("llama2", 4, 4), ("llama2", 4, 1),
    ("llama3", 8, 4), ("llama3", 8, 2),
    ("qwen2", 4, 2), ("qwen2", 4, 1),
    ("mistral", 8, 2), ("mistral", 8, 8),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}")
def pair(request, tmp_path_factory):
    variant, heads, kv_heads = request.param
    config = tiny_config(variant, num_attention_heads=heads, num_key_value_heads=kv_heads)
    directory = tmp_path_factory.mktemp(variant)
    hf_model = save_random_hf_model(config, directory, seed=request.param_index)
    ours = load_checkpoint(directory, dtype="float32", device="cpu", with_tokenizer=False)
    return hf_model, ours


def hf_logits(hf_model, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(token_ids[None]).logits[0].float()


def test_full_prefill(pair):
    hf_model, ours = pair
    ids = torch.randint(0, ours.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    logits = prefill(ours.model, ids, torch.arange(37), DenseKV(ours.config.num_hidden_layers))
    assert (logits - hf_logits(hf_model, ids)[-1]).abs().max() < TOLERANCE


def test_two_slices_over_paged_cache_then_eight_decode_steps(pair):
    hf_model, ours = pair
    config = ours.config
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                  block_size=4, num_blocks=256)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (29, 11)]
    sequences = []
    for index, ids in enumerate(prompts):
        cut = len(ids) // 2 + 1
        kv = pool.view(f"seq{index}")
        prefill(ours.model, ids[:cut], torch.arange(cut), kv, want_logits=False)
        logits = prefill(ours.model, ids[cut:], torch.arange(cut, len(ids)), kv)
        assert (logits - hf_logits(hf_model, ids)[-1]).abs().max() < TOLERANCE
        sequences.append([*ids.tolist(), int(logits.argmax())])
    # Eight batched decode steps over sequences of different lengths.
    for _ in range(8):
        tokens = torch.tensor([s[-1] for s in sequences])
        positions = torch.tensor([len(s) - 1 for s in sequences])
        logits = decode_step(ours.model, tokens, positions, [pool.view("seq0"), pool.view("seq1")])
        for row, sequence in enumerate(sequences):
            reference = hf_logits(hf_model, torch.tensor(sequence))[-1]
            assert (logits[row] - reference).abs().max() < TOLERANCE
            sequence.append(int(logits[row].argmax()))
