"""The header of a pushed cache as the decode pod sees it: what it needs to continue a
request whose KV a chain computed, and the first token when it follows the header."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baton.sampling.logprobs import TokenLogprobs
from baton.sampling.params import CompressionParams, SamplingParams
from baton.transfer.codec import KVHeader


@dataclass(frozen=True)
class KVHandoff:
    """What a decode pod needs to continue a request whose KV a chain pushed."""

    kv: KVHeader
    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    sampling: SamplingParams
    compression: CompressionParams
    decode_incarnation: str = ""  # of the decode pod the push is meant for ("" = any)
    cache_salt: str = ""  # the caller's tenant, for the decode pod's prefix cache
    prefill_s: float = 0.0  # the chain's time to the first token's logits (its tail's clock)
    partition: tuple[int, ...] = ()  # the slice boundaries the chain used
    # The three above come later, in a ``FirstToken`` (the header left before the chain had
    # them: the tail ships each layer as it is computed).
    first_token_follows: bool = False
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for them

    @property
    def request_id(self) -> str:
        return self.kv.request_id

    def with_first(self, first: FirstToken) -> KVHandoff:
        """The handoff completed by the first token that followed it."""
        return dataclasses.replace(self, first_token_id=first.token_id, prefill_s=first.prefill_s,
                                   partition=first.partition, first_token_follows=False,
                                   first_token_logprobs=first.logprobs)


@dataclass(frozen=True)
class FirstToken:
    """A pushed request's first token, sent after its header once the chain's logits exist."""

    token_id: int
    prefill_s: float = 0.0
    partition: tuple[int, ...] = ()
    logprobs: TokenLogprobs | None = None  # when the request asked for them
