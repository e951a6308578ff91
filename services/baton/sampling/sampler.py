"""Turning a step's logits into tokens: one ``Sampler`` per request, one ``draw`` per step.

Design: every request owns a ``Sampler``; the token at generated position p is drawn by
inverting the distribution's cumulative sum at a uniform number seeded from (seed, p). So a seeded request
samples the same tokens alone or in any batch, before or after being preempted and recomputed
(recomputed tokens are never re-sampled), and after its stream moved to another pod mid-way
(the new pod is told how many tokens came before, and they are the sampler's history again:
its penalties and grammar continue where they were). Sampling runs on the CPU whatever the
model's device, so a seed means the same thing on CPU and CUDA.

``draw`` processes all of a step's rows at once: penalties, biases and masks
(``baton.sampling.processors``), the structured-output grammars' masks, the log
probabilities, then temperature, min-p, top-k and top-p as tensors over the rows; only the seeded draw itself is one call per row. The chain's
tail draws a first token with the same function, so a token means the same on every route.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from baton.sampling.bitmask import apply_bitmask, new_bitmask
from baton.sampling.grammar import GrammarState
from baton.sampling.logprobs import TokenLogprobs, logprobs_of
from baton.sampling.params import SamplingParams
from baton.sampling.processors import process_logits


class Sampler:
    """One request's sampler: its parameters, seed, stop tokens and the tokens it generated."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 stop_ids: Iterable[int] = (), generated: Sequence[int] = (),
                 grammar: GrammarState | None = None) -> None:
        """``grammar``: the request's matcher, already past ``generated``."""
        self.params = params
        self.grammar = grammar
        self.seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.prompt_ids = prompt_ids  # the prompt proper, for the repetition penalty
        self.stop_ids = frozenset(stop_ids)  # held off while min_tokens are not reached
        self.generated: list[int] = list(generated)
        self._counts: dict[int, int] | None = None  # generated tokens' counts, once penalties need them
        self._prompt_only: list[int] = []

    def accept(self, token_id: int) -> bool:
        """A token of this request was chosen; False when its grammar does not allow it (a
        token chosen without the grammar's mask)."""
        self.generated.append(token_id)
        if self._counts is not None:
            self._count(token_id)
        return self.grammar is None or self.grammar.accept(token_id)

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """One row's token (a step of one): ``draw`` on it alone."""
        return draw(logits[None, :], [self], [position])[0].token_id

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution one row is drawn from. [vocab] fp32 CPU."""
        scores = process_logits(logits[None, :].to("cpu", torch.float32).clone(), [self], [0])
        return _distributions(scores, [self])[0]

    def penalized_tokens(self) -> tuple[list[int], list[int], list[int]]:
        """What the penalties read, kept up to date token by token: (the distinct generated
        tokens, how many times each was generated, the distinct tokens of the prompt that were
        not generated). Lists the size of what the request saw, never of the vocabulary."""
        if self._counts is None:
            self._counts = {}
            for token in self.generated:
                self._count(token)
            self._prompt_only = [token for token in dict.fromkeys(self.prompt_ids)
                                 if token not in self._counts]
        return list(self._counts), list(self._counts.values()), self._prompt_only

    def _count(self, token: int) -> None:
        self._counts[token] = self._counts.get(token, 0) + 1

    def uniform(self, position: int) -> float:
        """The request's uniform draw in [0, 1) for generated position ``position``."""
        return random.Random(_position_seed(self.seed, position)).random()


@dataclass(frozen=True)
class Draw:
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asked for them


def draw(logits: torch.Tensor, samplers: list[Sampler], positions: list[int]) -> list[Draw]:
    """Row i of ``logits`` [rows, vocab] turned into the token of ``samplers[i]`` at generated
    position ``positions[i]``. The rows are not changed."""
    scores = logits.to("cpu", torch.float32)
    if any(s.params.processes_logits for s in samplers):
        scores = process_logits(scores.clone(), samplers, positions)
        _mask_by_grammar(scores, samplers)
    tokens = scores.argmax(dim=1).tolist()
    random_rows = [row for row, s in enumerate(samplers) if not s.params.greedy]
    if random_rows:
        probs = _distributions(scores[random_rows], [samplers[row] for row in random_rows])
        uniforms = [samplers[row].uniform(positions[row]) for row in random_rows]
        for row, token in zip(random_rows, _inverse_cdf(probs, uniforms)):
            tokens[row] = token
    reporting = [row for row, s in enumerate(samplers) if s.params.logprobs is not None]
    reported = logprobs_of(scores[reporting], [tokens[row] for row in reporting],
                           [samplers[row].params.logprobs for row in reporting])
    logprobs: list[TokenLogprobs | None] = [None] * len(samplers)
    for row, entry in zip(reporting, reported):
        logprobs[row] = entry
    return [Draw(token, entry) for token, entry in zip(tokens, logprobs)]


def _mask_by_grammar(scores: torch.Tensor, samplers: list[Sampler]) -> None:
    """Every token its row's grammar does not allow next goes to -inf, in one call."""
    rows = [row for row, s in enumerate(samplers) if s.grammar is not None]
    if rows:
        bitmask = new_bitmask(len(samplers), scores.shape[1])
        for row in rows:
            samplers[row].grammar.fill_mask(bitmask, row)
        apply_bitmask(scores, bitmask, rows)


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Each row's token where its cumulative probability first passes its uniform draw: one
    cumulative sum and one search for all rows (a token of probability 0 is never drawn).
    (torch.multinomial costs many times more a row: docs/runtime-log.md.)"""
    cumulative = probs.to(torch.float64).cumsum(dim=1)
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cumulative[:, -1:]
    drawn = torch.searchsorted(cumulative, targets, right=True)
    return drawn[:, 0].clamp(max=probs.shape[1] - 1).tolist()


def _distributions(scores: torch.Tensor, samplers: list[Sampler]) -> torch.Tensor:
    """[rows, vocab] probabilities: temperature, then min-p, then top-k, then top-p (vLLM's
    order), each as one tensor operation over the rows that set it."""
    params = [s.params for s in samplers]
    scores = scores / torch.tensor([p.temperature for p in params])[:, None]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(scores, dim=-1)
        floor = probs.max(dim=1, keepdim=True).values * torch.tensor([p.min_p for p in params])[:, None]
        scores = scores.masked_fill(probs < floor, -math.inf)
    vocab = scores.shape[1]
    truncating = any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)
    if truncating:
        sorted_scores, order = torch.sort(scores, descending=True, dim=1)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        kth = sorted_scores.gather(1, torch.tensor(top_k)[:, None] - 1)
        scores = scores.masked_fill(scores < kth, -math.inf)
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, -math.inf)
        if any(p.top_p < 1.0 for p in params):
            # Drop a token when the tokens ranked above it already cover top_p (the top
            # token is always kept); a row without top_p keeps everything.
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params])
            drop = torch.zeros_like(scores, dtype=torch.bool)
            drop.scatter_(1, order, mass_before >= top_p[:, None])
            scores = scores.masked_fill(drop, -math.inf)
    return torch.softmax(scores, dim=-1)


def _position_seed(seed: int, position: int) -> int:
    """One generator seed per (request seed, position), spread by a 64-bit odd constant."""
    return (seed ^ ((position + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1)
