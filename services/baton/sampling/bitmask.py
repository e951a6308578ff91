"""Token bitmasks: which ids a constrained request may sample next, applied to logits.

A bitmask row holds one bit per token id, 32 ids to an int32 word, the lowest bit first
(id ``i`` is bit ``i % 32`` of word ``i // 32``); a set bit allows the id. Both grammar
libraries vLLM uses (llguidance, xgrammar) write this layout, and applying it needs only
torch, so the sampler applies it on whatever device its logits are.
"""

from __future__ import annotations

import torch

BITS_PER_WORD = 32


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch, ceil(vocab_size / 32)]`` int32 bitmask on the CPU (where the grammar
    libraries write), every id allowed: a row no grammar fills leaves its request free."""
    return torch.full((batch, num_words(vocab_size)), -1, dtype=torch.int32)


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
    vocab = logits.shape[1]
    index = None if rows is None else torch.tensor(rows, device=logits.device)
    words = bitmask[:logits.shape[0]] if index is None else bitmask[torch.tensor(rows)]
    words = words.to(logits.device, non_blocking=True)
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=logits.device)
    # [rows, words, 32] -> [rows, words * 32]: True where the id's bit is clear
    disallowed = ((words.unsqueeze(-1) >> shifts) & 1).eq(0).flatten(1)
    width = min(vocab, disallowed.shape[1])
    target = logits if index is None else logits.index_select(0, index)
    target[:, :width].masked_fill_(disallowed[:, :width], float("-inf"))
    target[:, width:] = float("-inf")
    if index is not None:
        logits.index_copy_(0, index, target)
