"""One request's life inside the engine, and the small results it hands out.

A ``Sequence`` is the scheduler's unit. Its tokens are ``prompt_ids +
output_ids``; ``num_computed`` of them have their KV in the pool (a logical
count: PyramidInfer may keep fewer entries per layer, but positions keep
counting). The next forward feeds ``token_ids[num_computed:]`` — several
tokens while prefilling (in chunks), exactly one once decoding. A token is
sampled only when a forward brings ``num_computed`` up to ``len(token_ids)``,
which makes a chunked prefill, a decode and a recompute after preemption the
same operation.

Under KV compression a sequence's tokens generated earlier (on another pod before a
migration, or here before a preemption) are not prefilled: ``replays_generated`` stops the
prefill at the request's own prompt, and decode steps feed the rest one token each, their
samples discarded, so the compressor sees them as it saw them when they were generated
(the prompt selected over the prompt alone, each later token's queries scoring the pruning
that followed it) and the cache it builds is the one the stream had.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.kv.dense import LayerKV
from baton.model.tokenizer import IncrementalDecoder
from baton.sampling.logprobs import TokenLogprobs
from baton.sampling.params import SamplingParams
from baton.sampling.sampler import Sampler
from baton.sampling.stops import StopStringMatcher


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted (new, or preempted and waiting to be recomputed)
    PREFILLING = "prefilling"  # admitted, its prompt KV is being computed chunk by chunk
    RUNNING = "running"  # decoding one token per iteration
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a sequence is one request, whatever its fields hold
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # engine-wide arrival counter: "newest" means the largest
    sampler: Sampler
    decoder: IncrementalDecoder | None
    stop_matcher: StopStringMatcher
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (its own, plus EOS unless ignored)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    compressor: object | None = None  # a baton.sarathi.hooks.SequenceCompressor
    # KV computed elsewhere (a prefill chain), stored into the pool on admission.
    arrived_kv: list[LayerKV] | None = None
    generated_before: int = 0  # the prompt ends with this many tokens generated on another pod
    # Feed the tokens generated before (on another pod, or here before a preemption) through
    # decode steps rather than the prefill (set with a compressor: see the module's note).
    replays_generated: bool = False
    # KV entries over all layers once this pod prefilled the prompt: (kept, full) — kept is
    # what compression left, full what the whole prompt takes. None: not prefilled here.
    kv_entries: tuple[int, int] | None = None
    cache_salt: str = ""  # the tenant's: prefix-cache hits only among requests with the same salt
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, filled lazily
    num_blocks_registered: int = 0  # leading full blocks offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (first admission)
    # The prompt's log probabilities so far, while its prefill computes them (when asked for).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """Tokens generated for the request so far, on this pod and before: the position of
        the next one to sample."""
        return self.generated_before + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, index: int) -> int:
        """``token_ids[index]`` without building the whole list (each decode reads one token
        a step, and joining a long prompt and its output for it costs a copy per sequence)."""
        num_prompt = len(self.prompt_ids)
        return self.prompt_ids[index] if index < num_prompt else self.output_ids[index - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def own_prompt_length(self) -> int:
        """The request's prompt without the tokens generated before it arrived here."""
        return len(self.prompt_ids) - self.generated_before

    @property
    def prefill_end(self) -> int:
        """Where its prefill stops: at its own prompt when it replays what it generated,
        else at its last token."""
        return self.own_prompt_length if self.replays_generated else self.num_tokens

    @property
    def num_to_prefill(self) -> int:
        return max(self.prefill_end - self.num_computed, 0)

    @property
    def samples_next(self) -> bool:
        """Is its next token unknown (every known token computed)? Else the forward that just
        ran replayed a token, and its sample is discarded."""
        return self.num_computed == self.num_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens the next forwards must feed before the next sample (1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def collects_prompt_logprobs(self) -> bool:
        """The request asked for its prompt's log probabilities and has no token yet: its
        prefill computes the logits of every prompt position (and takes no cached prefix)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def is_decoding(self) -> bool:
        return self.status is Status.RUNNING


@dataclass
class RequestOutput:
    """What one ``Engine.step()`` produced for one request (streamed to clients)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None = None  # set on the request's last output
    kv_entries: tuple[int, int] | None = None  # on the last output: Sequence.kv_entries
    num_cached_tokens: int = 0  # on the last output: Sequence.num_cached_tokens
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, when asked
    # with the first token, when asked for: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationResult:
    """A whole generation, as ``Engine.generate()`` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
