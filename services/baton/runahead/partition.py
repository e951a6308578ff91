"""Slice boundaries of a prompt over the ranks of a chain, and their validation.

A partition of a C-token prompt over p ranks is ``[b0=0, b1, ..., bp=C]``: rank
i computes tokens ``b_i..b_{i+1}``. Boundaries never decrease. A non-tail rank
may get an empty slice (it passes the cache it receives straight on), which is
how a prompt shorter than the chain still runs; the tail's slice may not be
empty, because the tail computes the first generated token from the prompt's
last token. Everything here runs before any rank starts, so bad input is a
``ValueError`` that names the value, never a broken chain.
"""

from __future__ import annotations

from collections.abc import Sequence


def even_boundaries(context_length: int, num_ranks: int) -> list[int]:
    """``b_i = floor(i * C / p)``: slices differ by at most one token; the tail's is never empty."""
    return [i * context_length // num_ranks for i in range(num_ranks + 1)]


def boundaries_from_fractions(fractions: Sequence[float], context_length: int) -> list[int]:
    """Cumulative fractions ``[f_1, ..., f_p=1]`` of the prompt -> token boundaries.

    Rounds to the nearest token, keeps boundaries non-decreasing and leaves the
    tail at least one token.
    """
    boundaries = [0]
    for fraction in fractions[:-1]:
        boundary = min(max(round(fraction * context_length), boundaries[-1]), context_length - 1)
        boundaries.append(boundary)
    boundaries.append(context_length)
    return boundaries


def fractions_of(boundaries: Sequence[int]) -> list[float]:
    """Token boundaries -> cumulative fractions ``[b_1/C, ..., 1.0]`` (the table's form)."""
    context_length = boundaries[-1]
    return [b / context_length for b in boundaries[1:]]


def validate_boundaries(boundaries: Sequence[int], num_ranks: int, context_length: int) -> list[int]:
    """Check a partition for a p-rank chain and a C-token prompt; returns it as a list of ints."""
    boundaries = [int(b) for b in boundaries]
    if len(boundaries) != num_ranks + 1:
        raise ValueError(f"partition {boundaries} has {len(boundaries) - 1} slices, "
                         f"the chain has {num_ranks} ranks (need {num_ranks + 1} boundaries)")
    if boundaries[0] != 0 or boundaries[-1] != context_length:
        raise ValueError(f"partition {boundaries} must run from 0 to the prompt length "
                         f"{context_length}")
    for rank in range(num_ranks):
        if boundaries[rank + 1] < boundaries[rank]:
            raise ValueError(f"partition {boundaries} decreases at rank {rank}: "
                             f"{boundaries[rank]} > {boundaries[rank + 1]}")
    if boundaries[-2] == context_length:
        raise ValueError(f"partition {boundaries} leaves the tail (rank {num_ranks - 1}) no tokens; "
                         f"it needs the prompt's last token to compute the first generated one")
    return boundaries
