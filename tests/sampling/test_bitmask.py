"""Applying a token bitmask: one batched call sets exactly the disallowed logits to -inf,
in the rows asked for, whatever the widths of the mask and the logits."""

from __future__ import annotations

import pytest
import torch
from baton.sampling.bitmask import apply_bitmask, new_bitmask


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    """The reference, one id at a time: bit i % 32 of word i // 32."""
    return {i for i in range(vocab) if (int(bitmask_row[i // 32]) >> (i % 32)) & 1}


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, new_bitmask(rows, vocab).shape,
                         dtype=torch.int32, generator=generator)


def test_new_bitmask_allows_everything():
    bitmask = new_bitmask(3, 100)
    assert bitmask.shape == (3, 4) and bitmask.dtype == torch.int32
    logits = torch.randn(3, 100)
    expected = logits.clone()
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [31, 32, 33, 1000])
def test_every_row_matches_the_reference(vocab, dtype):
    bitmask = random_bitmask(4, vocab, seed=vocab)
    logits = torch.randn(4, vocab).to(dtype)
    original = logits.clone()
    apply_bitmask(logits, bitmask)
    for row in range(4):
        allowed = allowed_ids(bitmask[row], vocab)
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed
        assert torch.equal(logits[row, sorted(allowed)], original[row, sorted(allowed)])


def test_only_the_rows_asked_for():
    bitmask = random_bitmask(5, 64, seed=1)
    logits = torch.randn(5, 64)
    original = logits.clone()
    apply_bitmask(logits, bitmask, rows=[1, 3])
    for row in (0, 2, 4):
        assert torch.equal(logits[row], original[row])
    for row in (1, 3):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed_ids(bitmask[row], 64)
    apply_bitmask(logits, bitmask, rows=[])
    assert torch.equal(logits[0], original[0])


def test_ids_past_the_mask_are_disallowed():
    """Logits wider than the mask (a model's padded vocabulary): the extra ids never win."""
    logits = torch.zeros(2, 40)
    apply_bitmask(logits, new_bitmask(2, 32))
    assert torch.isfinite(logits[:, :32]).all() and torch.isinf(logits[:, 32:]).all()
    logits = torch.zeros(3, 40)
    apply_bitmask(logits, new_bitmask(3, 32), rows=[1])
    assert torch.isinf(logits[1, 32:]).all() and torch.isfinite(logits[[0, 2]]).all()


def test_a_mask_wider_than_the_logits():
    logits = torch.zeros(1, 40)
    bitmask = new_bitmask(4, 64)  # preallocated for a larger batch and vocabulary
    bitmask[0, 0] = 0b101
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))
