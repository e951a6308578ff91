"""One request's token stream on a decode pod: the engine's loop thread writes, a gRPC
handler thread reads.

The loop thread turns each ``RequestOutput`` into a ``GenerationStep`` (``publish``) and puts
it on the stream's queue; the handler that serves the request (Generate, or Attach for a
pushed cache) takes steps off it (``next_step``) and converts them to protobuf. Steps pile up
in the queue until someone reads them, so tokens produced before an Attach arrives are not
lost. The last step carries the finish reason, usage and timings.

A pushed request's first token was sampled and streamed by the chain's tail: its token id
is left out of this stream, but its text is in the first step's text (the decode pod owns
the detokenizer, so the caller can relay text without one).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from baton.api.requests import FinishReason, GenerationStep, Route, Timings, Usage
from baton.model.sampling import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from baton.sarathi.request import RequestOutput

FINISH_REASONS = {FINISH_STOP: FinishReason.STOP, FINISH_LENGTH: FinishReason.LENGTH,
                  FINISH_ABORT: FinishReason.ABORTED}


class StreamFailed(Exception):
    """The engine failed while serving this request; the message says how."""


@dataclass
class PushedKVInfo:
    """What a pushed cache brought: for the final usage and for metrics."""

    num_bytes: int
    kv_tokens_kept: int
    kv_tokens_full: int


@dataclass
class RequestStream:
    request_id: str
    num_prompt_tokens: int
    route: Route
    pushed: PushedKVInfo | None = None  # None: prefilled on this pod
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0  # generated so far, the chain's first token included
    finished: bool = False
    attached: bool = False  # a handler is reading this stream
    queued: bool = False  # a local prompt counted in the worker's queue until its first token
    _steps: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    # --- the loop thread -----------------------------------------------------------------

    def publish(self, output: RequestOutput, now_s: float) -> list[float]:
        """Queue one engine output as a step; returns the gaps since the previous token (s)."""
        token_ids = list(output.new_token_ids)
        gaps = []
        if token_ids:
            if self.first_token_s is None:
                self.first_token_s = now_s
            elif self.last_token_s is not None:
                gaps = [now_s - self.last_token_s] * len(token_ids)
            self.last_token_s = now_s
            self.num_tokens += len(token_ids)
        if self.pushed is not None and self.num_tokens == len(token_ids):
            token_ids = token_ids[1:]  # the chain's first token: the caller has it already
        step = GenerationStep(self.request_id, tuple(token_ids), output.text_delta)
        if output.finished:
            self.finished = True
            step = self._final(step, FINISH_REASONS[output.finish_reason], now_s)
        if step.token_ids or step.text or output.finished:
            self._steps.put(step)
        return gaps

    def fail(self, message: str) -> None:
        self.finished = True
        self._steps.put(StreamFailed(message))

    def _final(self, step: GenerationStep, reason: FinishReason, now_s: float) -> GenerationStep:
        pushed = self.pushed or PushedKVInfo(0, 0, 0)
        usage = Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_tokens,
                      kv_tokens_kept=pushed.kv_tokens_kept, kv_tokens_full=pushed.kv_tokens_full,
                      kv_bytes_shipped=pushed.num_bytes)
        ttft_s = 0.0  # a pushed request's first token is timed by the chain
        if self.pushed is None and self.first_token_s is not None:
            ttft_s = self.first_token_s - self.arrival_s
        gaps = self.num_tokens - 1
        mean_gap_s = ((self.last_token_s - self.first_token_s) / gaps
                      if gaps > 0 and self.first_token_s is not None else 0.0)
        timings = Timings(ttft_s=ttft_s, prefill_s=ttft_s, mean_time_between_tokens_s=mean_gap_s,
                          total_s=now_s - self.arrival_s)
        return GenerationStep(step.request_id, step.token_ids, step.text, reason, usage, timings,
                              self.route)

    # --- the handler thread --------------------------------------------------------------

    def next_step(self, timeout_s: float) -> GenerationStep | None:
        """The next step, None when none came within ``timeout_s``; raises StreamFailed."""
        try:
            item = self._steps.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, StreamFailed):
            raise item
        return item
