"""What one request asks of sampling: the parameters, validated on construction.

Every field means what vLLM's ``SamplingParams`` field of the same name means (OpenAI's for
the penalties and ``logit_bias``), so a client moving from vLLM sees the same tokens for the
same logits. A request that sets none of the logits processors (``processes_logits``) takes
the step's fast path: its greedy token is the step's argmax, read without copying its row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton.sampling.grammar import GrammarSpec

FINISH_STOP = "stop"  # a stop token id, an end-of-sequence token or a stop string
FINISH_LENGTH = "length"  # max_tokens, the model's context or the KV pool's capacity
FINISH_ABORT = "abort"

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs, and vLLM's default max_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one logit_bias value
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty


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
    min_p: float = 0.0  # 0 = off; else drop tokens less likely than min_p x the best one's
    seed: int | None = None  # None = a fresh random seed per request
    max_tokens: int = 64
    # No stop token or end-of-sequence before this many tokens, counted from the request's
    # first (a stream moved to another pod after some keeps its count).
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token
    # Penalties: presence and frequency on the generated tokens (OpenAI's), repetition on
    # the prompt's and the generated ones (a positive logit divided, a negative multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None = every token
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never completed
    # Log probabilities: of each sampled token and this many alternatives (None = none), and of
    # each prompt token after the first and this many alternatives (None = none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # in the text: special tokens' text left out
    structured: GrammarSpec | None = None  # what the output must be (JSON schema, regex, ...)
    # Admission order where requests wait (a decode pod, a chain): lower first, vLLM's rule.
    # It rides with the sampling parameters, which cross every hop a request makes.
    priority: int = 0
    # Per-request KV compression overrides; the engine hands them to its compressor factory.
    compression: CompressionParams = field(default_factory=CompressionParams)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        bad_ids = [t for t in self.stop_token_ids if t < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be >= 0, got {bad_ids}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {bias} for token {token}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must name at least one token")
            if min(self.allowed_token_ids) < 0:
                raise ValueError(f"allowed_token_ids must be >= 0, got {min(self.allowed_token_ids)}")
        for words in self.bad_words_ids:
            if not words or min(words) < 0:
                raise ValueError(f"bad_words_ids must be non-empty lists of ids >= 0, got {words}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the model's logits before the draw (penalties, biases,
        masks): the logits the log probabilities and the greedy choice are taken from."""
        return (self.penalizes or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words_ids) or self.min_tokens > 0 or self.structured is not None)

    @property
    def fast_path(self) -> bool:
        """A greedy request with nothing to process or report: its token is the argmax."""
        return self.greedy and not self.processes_logits and self.logprobs is None

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The tokens that end the request: its own, and the model's end of sequence unless
        ignored."""
        return frozenset(self.stop_token_ids).union(() if self.ignore_eos else eos_token_ids)

    def token_ids_named(self) -> list[int]:
        """Every token id the parameters name (checked against the vocabulary at the edge)."""
        named = list(self.stop_token_ids) + list(self.logit_bias)
        named += self.allowed_token_ids or []
        for words in self.bad_words_ids:
            named += words
        return named
