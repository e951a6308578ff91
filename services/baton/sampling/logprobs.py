"""Log probabilities of chosen tokens and their most likely alternatives, for many rows at once.

Taken from the logits the draw reads after the request's penalties, biases and masks and
before temperature, top-k, top-p and min-p (vLLM's "processed" log probabilities, which for a
request without processors are the model's own ``log_softmax``). Prompt tokens' come from the
model's logits unprocessed, as vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log probability and rank (1 = the most likely), and
    the ``n`` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, token_ids: list[int], counts: list[int]) -> list[TokenLogprobs]:
    """Row i of ``logits`` [rows, vocab] scored for ``token_ids[i]`` with ``counts[i]``
    alternatives. One log_softmax and one top-k for all rows."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = torch.tensor(token_ids, dtype=torch.long)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1
    most = max(counts)
    top_values, top_ids = (torch.topk(logprobs, most, dim=1) if most
                           else (logprobs[:, :0], chosen[:, None][:, :0]))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(token, logprob, rank,
                          tuple(zip(top_ids[row][:count], top_values[row][:count])))
            for row, (token, logprob, rank, count) in enumerate(
                zip(token_ids, chosen_logprobs[:, 0].tolist(), ranks.tolist(), counts))]
