"""One request's token stream on a decode pod: the engine's loop thread writes, a gRPC
handler coroutine on the server's event loop reads.

The loop thread turns each ``RequestOutput`` into a ``GenerationStep`` (``publish``) and
appends it to the stream; once per engine step the worker wakes every stream it touched with
one hop onto the event loop (``wake``), and the handler that serves the request (Generate,
or Attach for a pushed cache) takes everything that arrived (``next_steps``), merged into one
message (``merge_steps``): a reader that falls behind sends fewer, larger messages instead of
a growing backlog. Steps pile up until someone reads them, so tokens produced before an
Attach arrives are not lost. The last step carries the finish reason, usage and timings.

A pushed request's first token was sampled by the chain's tail and comes on the push's
header: it is published as soon as the header checks out (``publish_first``), with its text
unless stop strings decide what text is released; the engine's first output repeats it
once the KV has landed, and that repetition is left out here, token and text.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
from dataclasses import dataclass, field

from baton import tracing
from baton.api.requests import FinishReason, GenerationStep, Route, Timings, Usage
from baton.errors import ServiceError
from baton.sampling.logprobs import TokenLogprobs
from baton.sampling.params import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from baton.sarathi.request import RequestOutput

FINISH_REASONS = {FINISH_STOP: FinishReason.STOP, FINISH_LENGTH: FinishReason.LENGTH,
                  FINISH_ABORT: FinishReason.ABORTED}


class StreamFailed(ServiceError):
    """The engine failed while serving this request; the message says how."""


class PushLost(StreamFailed):
    """The chain's push broke after its header: the caller has the first token and nothing
    more will come from here (DATA_LOSS: the KV was lost on its way, not this pod, so the
    gateway continues the stream on any live pod, this one included)."""

    status = "DATA_LOSS"


class EngineStalled(StreamFailed):
    """The engine made no progress for too long: this pod is leaving, another may take the
    request (UNAVAILABLE, which the gateway answers by moving the stream elsewhere)."""

    status = "UNAVAILABLE"


@dataclass
class PushedKVInfo:
    """What a pushed cache brought: for the final usage, timings and route, and for metrics."""

    num_bytes: int
    kv_tokens_kept: int
    kv_tokens_full: int
    prefill_s: float = 0.0  # the chain's, from the header
    partition: tuple[int, ...] = ()
    push_s: float = 0.0  # header arrival to the last byte checked, on this pod


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
    expired: bool = False  # pushed, and no Attach came within the lease: aborted
    queued: bool = False  # a local prompt counted in the worker's queue until its first token
    scheduled: bool = False  # a local prompt's first prefill chunk ran (queue time observed)
    in_engine: bool = True  # False while a pushed request's KV is still arriving
    leaving: bool = False  # aborted: the engine's last output for it is on its way
    _repeat: bool = False  # the engine's first output will repeat the header's first token
    _echo: str = ""  # and the text of it that was shown, still to be left out
    _steps: collections.deque = field(default_factory=collections.deque)  # appended by the loop thread
    _ready: asyncio.Event | None = None  # made by the reader, on the server's event loop
    _holding: asyncio.Event | None = None  # set while a reader holds for more steps
    _taken_any: bool = False  # a reader has taken steps
    _taken: asyncio.Event | None = None  # set when it does, while a push waits for that
    traceparent: str = ""  # W3C: the caller's span (the push's, when pushed); "" = untraced
    first_step_s: float | None = None  # when the engine's first output for it came

    # --- the loop thread -----------------------------------------------------------------

    def publish_first(self, token_id: int, text: str, now_s: float,
                      logprobs: TokenLogprobs | None = None) -> None:
        """A pushed request's first token, from its header (``text``: what may be shown now)."""
        self.first_token_s = self.last_token_s = now_s
        self.num_tokens = 1
        self._repeat, self._echo = True, text
        self._steps.append(GenerationStep(self.request_id, (token_id,), text,
                                          logprobs=(logprobs,) if logprobs else ()))

    def publish(self, output: RequestOutput, now_s: float) -> list[float]:
        """Queue one engine output as a step; returns the gaps since the previous token (s)."""
        token_ids = list(output.new_token_ids)
        logprobs = output.logprobs
        text = output.text_delta
        if self.first_step_s is None and (token_ids or output.finished):
            self.first_step_s = now_s
        if self._repeat and token_ids:  # the engine repeats the header's first token
            token_ids, logprobs, self._repeat = token_ids[1:], logprobs[1:], False
        if self._echo:  # and its text (the same decoder's, so the text starts with it)
            overlap = len(os.path.commonprefix([self._echo, text]))
            text, self._echo = text[overlap:], self._echo[overlap:]
        gaps = []
        if token_ids:
            if self.first_token_s is None:
                self.first_token_s = now_s
            elif self.last_token_s is not None:
                gaps = [now_s - self.last_token_s] * len(token_ids)
            self.last_token_s = now_s
            self.num_tokens += len(token_ids)
        step = GenerationStep(self.request_id, tuple(token_ids), text, logprobs=tuple(logprobs),
                              prompt_logprobs=tuple(output.prompt_logprobs or ()))
        if output.finished:
            self.finished = True
            step = self._final(step, FINISH_REASONS[output.finish_reason], now_s, output.kv_entries,
                               output.num_cached_tokens)
        if step.token_ids or step.text or step.prompt_logprobs or output.finished:
            self._steps.append(step)
        return gaps

    def record_trace(self, now_s: float) -> None:
        """The pod's spans of a traced request that ended: its whole stay, and its first step
        (a local prompt's queue, prefill and first token; a pushed one's first step once its
        KV was in)."""
        span = tracing.start("baton.decode.request", self.traceparent, self.arrival_s, server=True,
                             attributes={"baton.request_id": self.request_id,
                                         "baton.decode": self.route.decode_address,
                                         "baton.pushed": self.pushed is not None})
        if self.first_step_s is not None:
            began_s = self.arrival_s + (self.pushed.push_s if self.pushed is not None else 0.0)
            tracing.record("baton.decode.first_step", span, began_s, self.first_step_s)
        tracing.end(span, now_s, {"baton.prompt_tokens": self.num_prompt_tokens,
                                  "baton.completion_tokens": self.num_tokens})

    def fail(self, message: str, error: type[StreamFailed] = StreamFailed) -> None:
        self.finished = True
        self._steps.append(error(message))

    def _final(self, step: GenerationStep, reason: FinishReason, now_s: float,
               kv_entries: tuple[int, int] | None = None,
               num_cached_tokens: int = 0) -> GenerationStep:
        # KV entries mean the same on both routes: after the prompt's compression, all layers
        # (a prompt prefilled here reports what this pod kept; a pushed one what the chain sent)
        kept, full = kv_entries or (0, 0)
        pushed = self.pushed or PushedKVInfo(0, kept, full)
        usage = Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_tokens,
                      kv_tokens_kept=pushed.kv_tokens_kept, kv_tokens_full=pushed.kv_tokens_full,
                      kv_bytes_shipped=pushed.num_bytes, cached_prompt_tokens=num_cached_tokens)
        ttft_s = 0.0 if self.first_token_s is None else self.first_token_s - self.arrival_s
        gaps = self.num_tokens - 1
        mean_gap_s = ((self.last_token_s - self.first_token_s) / gaps
                      if gaps > 0 and self.first_token_s is not None else 0.0)
        route = self.route
        if self.pushed is None:
            timings = Timings(ttft_s=ttft_s, prefill_s=ttft_s, mean_time_between_tokens_s=mean_gap_s,
                              total_s=now_s - self.arrival_s)
        else:  # from the header's arrival; the chain's own time came with it
            timings = Timings(ttft_s=ttft_s, prefill_s=self.pushed.prefill_s,
                              kv_push_s=self.pushed.push_s,
                              mean_time_between_tokens_s=mean_gap_s, total_s=now_s - self.arrival_s)
            route = dataclasses.replace(route, partition=self.pushed.partition)
        return dataclasses.replace(step, finish_reason=reason, usage=usage, timings=timings,
                                   route=route)

    # --- the server's event loop ------------------------------------------------------------

    def wake(self) -> None:
        """Steps were appended (called on the event loop, after the appends)."""
        if self._ready is not None:
            self._ready.set()
        if self.finished and self._holding is not None:
            self._holding.set()  # the end is there: a holding reader sends it now

    async def next_steps(self, hold_until: float = 0.0) -> GenerationStep:
        """Everything published since the last call, merged into one step; waits for at least
        one, then until ``hold_until`` (event-loop time) for more to join it unless the stream
        ends first. Raises StreamFailed (after the steps that came before the failure were
        taken)."""
        if self._ready is None:
            self._ready = asyncio.Event()
        while not self._steps:  # a step appended after this check comes with a wake after it
            self._ready.clear()
            await self._ready.wait()
        await self._hold(hold_until)
        steps = []
        while self._steps and not isinstance(self._steps[0], StreamFailed):
            steps.append(self._steps.popleft())
        if not steps:
            raise self._steps.popleft()
        self._taken_any = True
        if self._taken is not None:
            self._taken.set()
        return merge_steps(steps)

    async def first_taken(self, timeout_s: float) -> None:
        """Until a reader has taken the first step, or ``timeout_s``."""
        if self._taken_any:
            return
        self._taken = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._taken.wait()
        except TimeoutError:
            pass
        finally:
            self._taken = None

    async def _hold(self, until: float) -> None:
        """Sleep until ``until`` or the stream's end, whichever comes first. Only the end wakes
        a holder early: the steps in between would cost a wake-up each."""
        loop = asyncio.get_running_loop()
        remaining_s = until - loop.time()
        if remaining_s <= 0 or self.finished:  # no await since the check: wake() comes after
            return
        self._holding = asyncio.Event()
        timer = loop.call_later(remaining_s, self._holding.set)
        try:
            await self._holding.wait()
        finally:
            timer.cancel()
            self._holding = None


def merge_steps(steps: list[GenerationStep]) -> GenerationStep:
    """Consecutive steps of one request as one: their tokens and text in order, the last
    one's finish reason and summary."""
    if len(steps) == 1:
        return steps[0]
    token_ids = tuple(token for step in steps for token in step.token_ids)
    return dataclasses.replace(steps[-1], token_ids=token_ids,
                               text="".join(step.text for step in steps),
                               logprobs=tuple(entry for step in steps for entry in step.logprobs),
                               prompt_logprobs=steps[0].prompt_logprobs)
