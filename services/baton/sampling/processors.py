"""A step's logits processors: what a request's parameters change in its logits before the draw.

Each runs once per step over the rows that set it, as tensor operations (index lists built
from the requests' token histories, never a Python loop over the vocabulary). The order is
vLLM's: the repetition penalty, then frequency and presence, then ``logit_bias``, then the
masks (``allowed_token_ids``, ``bad_words``, stop tokens held off by ``min_tokens``).
"""

from __future__ import annotations

import math

import torch


def process_logits(scores: torch.Tensor, samplers: list, positions: list[int]) -> torch.Tensor:
    """``scores`` [rows, vocab] fp32 (changed in place and returned) as ``samplers[i]`` at
    generated position ``positions[i]`` changes row i."""
    penalized = [row for row, s in enumerate(samplers) if s.params.penalizes]
    if penalized:
        _penalize(scores, [samplers[row] for row in penalized], penalized)
    _bias(scores, samplers)
    _mask(scores, samplers, positions)
    return scores


def _penalize(scores: torch.Tensor, samplers: list, rows: list[int]) -> None:
    vocab = scores.shape[1]
    counts = _token_counts([s.generated for s in samplers], vocab)
    in_output = counts > 0
    repetition = [s.params.repetition_penalty for s in samplers]
    subset = scores[rows]
    if any(value != 1.0 for value in repetition):
        seen = in_output | (_token_counts([s.prompt_ids for s in samplers], vocab) > 0)
        penalty = torch.tensor(repetition)[:, None].expand_as(subset)
        penalized = torch.where(subset > 0, subset / penalty, subset * penalty)
        subset = torch.where(seen, penalized, subset)
    frequency = torch.tensor([s.params.frequency_penalty for s in samplers])[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in samplers])[:, None]
    subset = subset - frequency * counts - presence * in_output
    scores[rows] = subset


def _token_counts(histories: list, vocab: int) -> torch.Tensor:
    """[len(histories), vocab]: how many times each token occurs in each history."""
    counts = torch.zeros(len(histories), vocab)
    lengths = [len(history) for history in histories]
    if sum(lengths):
        rows = torch.repeat_interleave(torch.arange(len(histories)), torch.tensor(lengths))
        tokens = torch.tensor([token for history in histories for token in history], dtype=torch.long)
        counts.index_put_((rows, tokens), torch.ones(len(tokens)), accumulate=True)
    return counts


def _bias(scores: torch.Tensor, samplers: list) -> None:
    rows, tokens, values = [], [], []
    for row, sampler in enumerate(samplers):
        for token, value in sampler.params.logit_bias.items():
            rows.append(row)
            tokens.append(token)
            values.append(value)
    if rows:
        scores.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(values),
                          accumulate=True)


def _mask(scores: torch.Tensor, samplers: list, positions: list[int]) -> None:
    rows, tokens = [], []
    for row, (sampler, position) in enumerate(zip(samplers, positions)):
        params = sampler.params
        if params.allowed_token_ids is not None:
            kept = scores[row, params.allowed_token_ids].clone()
            scores[row] = -math.inf
            scores[row, params.allowed_token_ids] = kept
        banned = [words[-1] for words in params.bad_words_ids
                  if _ends_with(sampler.generated, words[:-1])]
        if position < params.min_tokens:
            banned += sampler.stop_ids
        rows += [row] * len(banned)
        tokens += banned
    if rows:
        scores[torch.tensor(rows), torch.tensor(tokens, dtype=torch.long)] = -math.inf


def _ends_with(history: list[int], prefix: list[int]) -> bool:
    return not prefix or (len(history) >= len(prefix) and history[-len(prefix):] == prefix)
