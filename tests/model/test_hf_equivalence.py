"""Our logits equal Hugging Face transformers on the same random weights (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from baton.kv import DenseKV, KVPool
from baton.model import decode_step, load_checkpoint, prefill
from hf_reference import EQUIVALENCE_CASES, case_id, save_case

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=EQUIVALENCE_CASES, ids=case_id)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param[0])
    hf_model = save_case(request.param, directory, seed=request.param_index)
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
