"""Turning one sequence's logits into its next token, and knowing when to stop.

Design: every request owns a ``Sampler`` with its own ``torch.Generator``; the
token at generated position p is drawn with the generator seeded from (seed, p).
So a seeded request samples the same tokens alone or in any batch, before or
after being preempted and recomputed (recomputed tokens are never re-sampled),
and after its stream moved to another pod mid-way (the new pod is told how many
tokens came before). Sampling runs on the CPU generator whatever the model's
device, so a seed means the same thing on CPU and CUDA.

Stop strings are matched on decoded text, across token boundaries: text that
could still be the start of a stop string is held back until it can be ruled
out, so a stop string never reaches the client.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

FINISH_STOP = "stop"  # a stop token id, an end-of-sequence token or a stop string
FINISH_LENGTH = "length"  # max_tokens, the model's context or the KV pool's capacity
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class CompressionParams:
    """One request's overrides of the deployment's KV compression (None = the deployment's)."""

    enabled: bool | None = None
    keep_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.keep_ratio is not None and not 0 < self.keep_ratio <= 1:
            raise ValueError(f"compression keep_ratio must be in (0, 1], got {self.keep_ratio}")


@dataclass
class SamplingParams:
    """How one request samples and when it stops (validated on construction)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed per request
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    # Per-request KV compression overrides; the engine hands them to its compressor factory.
    compression: CompressionParams = field(default_factory=CompressionParams)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        bad_ids = [t for t in self.stop_token_ids if t < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad_ids}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One request's sampler: logits [vocab] -> token id, reproducible from the seed."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self._generator: torch.Generator | None = None
        if not params.greedy:
            self._generator = torch.Generator(device="cpu")

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """The token at generated position ``position`` (0 = the first generated token)."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.probabilities(logits)
        self._generator.manual_seed(_position_seed(self.seed, position))
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from: temperature, then top-k, then top-p. [vocab] fp32 CPU."""
        scores = logits.detach().to("cpu", torch.float32) / self.params.temperature
        top_k = self.params.top_k
        if 0 < top_k < scores.shape[0]:
            kth = torch.topk(scores, top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the tokens ranked above it already cover top_p
            # (the top token is always kept).
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = torch.zeros_like(scores, dtype=torch.bool)
            drop[order] = mass_before >= self.params.top_p
            scores = scores.masked_fill(drop, -math.inf)
        return torch.softmax(scores, dim=-1)


class StopStringMatcher:
    """Finds stop strings in streamed text deltas, holding back what could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._pending = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found). After a stop, the
        emitted text ends just before the stop string."""
        if not self.stops:  # nothing to look for (most requests): every delta goes out as is
            return delta, False
        text = self._pending + delta
        hits = [index for index in (text.find(s) for s in self.stops) if index >= 0]
        if hits:
            self._pending = ""
            return text[:min(hits)], True
        held = self._held_suffix(text)
        self._pending = text[len(text) - held:]
        return text[:len(text) - held], False

    def flush(self) -> str:
        """The held-back text, once the sequence ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _position_seed(seed: int, position: int) -> int:
    """One generator seed per (request seed, position), spread by a 64-bit odd constant."""
    return (seed ^ ((position + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1)
