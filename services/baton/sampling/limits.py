"""What a request must satisfy to run on a model: one rule, used by every edge.

The gateway, a decode pod's Generate, a pushed cache's handoff, a chain's rank 0 and the
engine itself (``baton generate`` and every in-process caller) all check a request with
``check_prompt``: the prompt's rule (``baton.model.limits.check_prompt_ids``), every token
id the sampling names inside the vocabulary, and the prompt plus ``max_tokens`` within the
model's context. Resource limits (the KV pool's size, queue bounds) are the engine's and
servers' own, and say so in their messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.configtree import require
from baton.model.limits import check_prompt_ids
from baton.sampling.params import SamplingParams


def check_prompt(token_ids: Sequence[int], sampling: SamplingParams, vocab_size: int,
                 max_model_len: int) -> None:
    """Raise ValueError unless the prompt and its sampling fit a model with these limits."""
    check_prompt_ids(token_ids, vocab_size, max_model_len)
    bad = [token for token in sampling.token_ids_named() if token >= vocab_size]
    require(not bad, f"token ids {bad[:8]} in the sampling parameters (stop_token_ids, "
                     f"logit_bias, allowed_token_ids, bad words) are outside the vocabulary "
                     f"0..{vocab_size - 1}")
    total = len(token_ids) + sampling.max_tokens
    require(total <= max_model_len,
             f"prompt of {len(token_ids)} tokens + max_tokens {sampling.max_tokens} = {total} "
             f"exceeds the model's limit of {max_model_len} tokens")
