"""Token bitmasks: which ids a constrained request may sample next, applied to logits.

A bitmask row holds one bit per token id, 32 ids to an int32 word, the lowest bit first
(id ``i`` is bit ``i % 32`` of word ``i // 32``); a set bit allows the id. Both grammar
libraries vLLM uses (llguidance, xgrammar) write this layout, and applying it needs only
torch, so the sampler applies it on whatever device its logits are.

Applying reads the mask a byte at a time: each byte picks its 8 ids' additive terms
(0 or -inf) from a 256-row table, and the logits add them. One gather and one add over
the logits, where unpacking bits with shifts makes several passes over [rows, vocab]
int32 tensors (docs/runtime-log.md, "Structured outputs").
"""

from __future__ import annotations

import functools
import sys

import torch

BITS_PER_WORD = 32
# A word's bytes in memory order are its bits 0-7, 8-15, ...: the byte-wise read needs a
# little-endian host (as every host torch ships for).
assert sys.byteorder == "little"


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch, ceil(vocab_size / 32)]`` int32 bitmask on the CPU (where the grammar
    libraries write), every id allowed: a row no grammar fills leaves its request free."""
    return torch.full((batch, num_words(vocab_size)), -1, dtype=torch.int32)


@functools.cache
def _terms_by_byte(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: row b holds 0 for the ids whose bit is set in byte b, -inf for the rest."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype=dtype, device=device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: list[int] | None = None) -> None:
    """Sets the logits of disallowed ids to -inf, in place, for every row at once.

    ``logits``: [num_rows, vocab] float; ``bitmask``: [>= num_rows, words] int32, on any
    device (copied to the logits'). ``rows``: the rows constrained (the same index in both
    tensors); None: every row of ``logits``. Ids past the bitmask's width (a model
    vocabulary wider than the mask) are disallowed too.
    """
    if rows is not None and not rows:
        return
    num_rows, vocab = logits.shape
    words = bitmask[:num_rows] if rows is None else bitmask[torch.tensor(rows)]
    mask_bytes = words.to(logits.device, non_blocking=True).contiguous().view(torch.uint8)
    terms = _terms_by_byte(logits.dtype, logits.device)
    # [rows, words * 4] bytes -> [rows, words * 32] terms, 8 ids a byte
    terms = terms.index_select(0, mask_bytes.flatten().long()).view(len(mask_bytes), -1)
    width = min(vocab, terms.shape[1])
    if rows is None:
        logits[:, :width] += terms[:, :width]
        logits[:, width:] = float("-inf")
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[:, :width].index_add_(0, index, terms[:, :width])
        logits[:, width:].index_fill_(0, index, float("-inf"))
