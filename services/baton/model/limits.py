"""What a prompt must satisfy to run on a model: non-empty, its token ids inside the
vocabulary, within the model's context. ``baton.sampling.limits.check_prompt`` adds the
request's sampling to the same rule; a chain's prompt alone (``runahead.make_request``,
which samples nothing) is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.configtree import require


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError unless the prompt's ids fit a model with these limits."""
    require(len(token_ids) > 0, "the prompt is empty")
    require(len(token_ids) <= max_model_len,
            f"prompt of {len(token_ids)} tokens exceeds the model's limit of {max_model_len} tokens")
    bad = [token for token in token_ids if not 0 <= token < vocab_size]
    require(not bad, f"prompt token ids {bad[:8]} are outside the vocabulary 0..{vocab_size - 1}")
