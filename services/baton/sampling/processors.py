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
    """Only the tokens each request saw are read and written (a few hundred, where the
    vocabulary may have a hundred thousand)."""
    pairs_rows, pairs_tokens, counts, repetition, frequency, presence = [], [], [], [], [], []
    for row, sampler in zip(rows, samplers):
        generated, generated_counts, prompt_only = sampler.penalized_tokens()
        params = sampler.params
        tokens = generated + (prompt_only if params.repetition_penalty != 1.0 else [])
        pairs_rows += [row] * len(tokens)
        pairs_tokens += tokens
        counts += generated_counts + [0] * (len(tokens) - len(generated))
        repetition += [params.repetition_penalty] * len(tokens)
        frequency += [params.frequency_penalty] * len(tokens)
        presence += [params.presence_penalty] * len(tokens)
    if not pairs_rows:
        return
    index = (torch.tensor(pairs_rows), torch.tensor(pairs_tokens, dtype=torch.long))
    values = scores[index]
    penalty = torch.tensor(repetition)
    values = torch.where(values > 0, values / penalty, values * penalty)
    times = torch.tensor(counts, dtype=torch.float32)
    values -= torch.tensor(frequency) * times + torch.tensor(presence) * (times > 0)
    scores[index] = values


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
