"""Where a chain pays: the rule a chain's break-even comes from.

A prompt of L tokens reaches its first token on either route at

    TTFT_local(L) = hop_local + prefill_1(L)
    TTFT_chain(L) = hop_chain + prefill_chain(L) + kv_bytes(L) / bandwidth

prefill_1 and prefill_chain are measured per length in the chain's partition table (``baton
tune-partitions`` on the pods' hardware: each entry's ``ttft_single_s`` and ``ttft_s``);
kv_bytes(L) is L times what the tail ships per token (the model's shape and KV dtype, the
fraction PyramidInfer keeps); the link's bandwidth and the chain route's extra hop
(hop_chain - hop_local) are the deployment's (``ChainConfig``). A chain advertises the
shortest measured length from which its route wins at every longer measured length, and the
gateway sends it prompts from there (``chain_break_even``). ``bench/pd_model.py`` predicts
served TTFTs with these same functions and checks them against measured ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

POSITION_BYTES = 8  # each kept token's position travels with its keys and values (int64)


@dataclass(frozen=True)
class Link:
    """What a chain's route costs beyond its compute: moving the KV, and one more hop."""

    bytes_per_s: float = math.inf  # inf: free (compute alone decides)
    extra_hop_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"a link's bandwidth must be > 0 bytes/s, got {self.bytes_per_s}")
        if not (math.isfinite(self.extra_hop_s) and self.extra_hop_s >= 0):
            raise ValueError(f"a chain's extra hop must be >= 0 s, got {self.extra_hop_s}")

    def cost_s(self, kv_bytes: float) -> float:
        return self.extra_hop_s + kv_bytes / self.bytes_per_s


COMPUTE_ONLY = Link()


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int,
                       kept: float = 1.0) -> float:
    """PushKV's payload per prompt token: every layer's key, value and position, times the
    fraction of tokens the request's compression keeps."""
    return num_layers * (2 * num_kv_heads * head_dim * element_bytes + POSITION_BYTES) * kept


def chain_ttft_s(prefill_chain_s: float, num_tokens: int, kv_per_token: float,
                 link: Link) -> float:
    """The chain route's compute and transfer (its hop beyond the local route's included)."""
    return prefill_chain_s + link.cost_s(num_tokens * kv_per_token)


def break_even(points: Iterable[tuple[int, float, float]], kv_per_token: float = 0.0,
               link: Link = COMPUTE_ONLY) -> int:
    """The shortest measured length from which the chain's route is faster at every longer
    measured length; twice the longest measured when it never is (beyond what was seen).
    ``points``: (prompt tokens, prefill_1 s, prefill_chain s), in any order."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError("a break-even needs at least one measured length")
    winning = None
    for num_tokens, single_s, chain_s in reversed(ordered):
        if chain_ttft_s(chain_s, num_tokens, kv_per_token, link) >= single_s:
            break
        winning = num_tokens
    return winning if winning is not None else 2 * ordered[-1][0]
