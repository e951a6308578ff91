"""OpenAI's response bodies: a whole answer, a stream's chunks, the usage, an error.

``Answer`` knows one request's ids and shape (chat or text completion); ``Choice`` is one
generation gathered whole. Log probabilities take OpenAI's two shapes: a completion's
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (echoed prompt tokens first,
the first with no log probability) and a chat's ``{"content": [{"token", "logprob",
"bytes", "top_logprobs"}]}``. A log probability of minus infinity (a token a mask ruled out)
is written as -9999.0, as vLLM writes it: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.api.requests import FinishReason, GenerationStep, Usage
from baton.gateway.http.chat_output import ChatOutput
from baton.gateway.http.protocol import Completion
from baton.sampling.logprobs import TokenLogprobs

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORTED: "abort"}
LOWEST_LOGPROB = -9999.0


def usage_body(usage: Usage | None) -> dict:
    usage = usage or Usage()
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def baton_body(request_id: str, step: GenerationStep) -> dict:
    """baton's own account of a finished request, beside OpenAI's fields: where it ran, what
    its KV cost and its timings (what the gRPC API's last message carries)."""
    usage, timings, route = step.usage or Usage(), step.timings, step.route
    body = {"request_id": request_id,
            "kv_tokens_kept": usage.kv_tokens_kept, "kv_tokens_full": usage.kv_tokens_full,
            "kv_bytes_shipped": usage.kv_bytes_shipped}
    if route is not None:
        body["route"] = {"decode_address": route.decode_address, "chain_id": route.chain_id,
                         "path": "chain" if route.chain_id else "local", "reason": route.reason}
    if timings is not None:
        body["timings"] = {"ttft_s": timings.ttft_s, "prefill_s": timings.prefill_s,
                           "kv_push_s": timings.kv_push_s, "total_s": timings.total_s,
                           "mean_time_between_tokens_s": timings.mean_time_between_tokens_s}
    return body


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


@dataclass
class Choice:
    """One generation, whole: what a non-streamed answer's choice is built from."""

    index: int
    last: GenerationStep  # its last step: finish reason, usage, timings, route
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_ids: tuple[int, ...] = ()
    prompt_text: str = ""  # echoed before the text
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    chat_output: ChatOutput | None = None  # a chat's: how its text becomes the message

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


@dataclass
class Answer:
    """How one request is answered: its ids, the shape of its JSON, and how a token reads
    (``token_text``: one token's text, for log probabilities)."""

    chat: bool
    response_id: str
    model: str
    created: int
    token_text: Callable[[int], str] = str
    logprobs: bool = False  # the request asked for log probabilities
    echo: bool = False
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field, beside the choices

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model}

    def whole(self, choices: list[Choice], usage: Usage, return_token_ids: bool) -> dict:
        """The non-streaming response."""
        bodies = []
        for choice in choices:
            body = {"index": choice.index, "logprobs": None,
                    "finish_reason": FINISH_REASONS[choice.last.finish_reason]}
            if self.chat:
                output = choice.chat_output or ChatOutput(None, None)
                body["message"] = output.message(choice.text)
                body["finish_reason"] = output.finish_reason(
                    body["finish_reason"], called=bool(body["message"].get("tool_calls")))
                if self.logprobs:
                    body["logprobs"] = self.chat_logprobs(choice.logprobs)
            else:
                body["text"] = choice.prompt_text + choice.text if self.echo else choice.text
                if self.logprobs:
                    body["logprobs"] = self.completion_logprobs(choice)
            if self.prompt_logprobs:
                body["prompt_logprobs"] = self.vllm_prompt_logprobs(choice)
            if return_token_ids:
                body["token_ids"] = choice.token_ids
            bodies.append(body)
        return {**self._head(self.object), "choices": bodies, "usage": usage_body(usage),
                "baton": baton_body(self.response_id, choices[0].last)}

    def chunk(self, text: str | None, finish_reason: FinishReason | str | None, include_usage: bool,
              role: bool = False, token_ids: tuple[int, ...] | None = None, index: int = 0,
              logprobs: dict | None = None, delta: dict | None = None) -> dict:
        """One streamed chunk: ``text`` (None: no content, e.g. the chat's last chunk), the
        finish reason on the last; ``role`` on a chat stream's first; ``token_ids`` when
        asked for; ``logprobs`` already shaped (``chat_logprobs`` or ``completion_logprobs``);
        ``delta``: a chat's delta as ``ChatOutput`` read it, in place of ``text``."""
        if isinstance(finish_reason, FinishReason):
            finish_reason = FINISH_REASONS[finish_reason]
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            delta = dict(delta) if delta is not None else {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        body = {**self._head(f"{self.object}.chunk" if self.chat else self.object),
                "choices": [choice]}
        if include_usage:  # OpenAI: every chunk has "usage", null but the last
            body["usage"] = None
        return body

    def usage_chunk(self, last: GenerationStep, usage: Usage | None = None) -> dict:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(f"{self.object}.chunk" if self.chat else self.object), "choices": [],
                "usage": usage_body(usage or last.usage), "baton": baton_body(self.response_id, last)}

    # --- log probabilities ------------------------------------------------------------------

    def chat_logprobs(self, entries: list[TokenLogprobs]) -> dict:
        content = []
        for entry in entries:
            token = self.token_text(entry.token_id)
            content.append({"token": token, "logprob": _finite(entry.logprob),
                            "bytes": list(token.encode()),
                            "top_logprobs": [self._chat_alternative(token_id, logprob)
                                             for token_id, logprob in entry.top]})
        return {"content": content}

    def _chat_alternative(self, token_id: int, logprob: float) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    def completion_logprobs(self, choice: Choice, offset: int = 0,
                            entries: list[TokenLogprobs] | None = None) -> dict:
        """A completion's log probabilities: the echoed prompt's then the generated tokens'
        (``entries``: a streamed chunk's only, its text starting at ``offset``)."""
        tokens, logprobs, tops, offsets = [], [], [], []
        if entries is None:
            entries = choice.logprobs
            if self.echo:
                for position, token_id in enumerate(choice.prompt_ids):
                    text = self.token_text(token_id)
                    tokens.append(text)
                    offsets.append(offset)
                    offset += len(text)
                    entry = choice.prompt_logprobs[position - 1] if position else None
                    logprobs.append(None if entry is None else _finite(entry.logprob))
                    tops.append(None if entry is None else self._top_dict(entry))
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            logprobs.append(_finite(entry.logprob))
            tops.append(self._top_dict(entry))
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _top_dict(self, entry: TokenLogprobs) -> dict:
        """The alternatives and the token itself (vLLM's completions include it)."""
        top = {self.token_text(token_id): _finite(logprob) for token_id, logprob in entry.top}
        top.setdefault(self.token_text(entry.token_id), _finite(entry.logprob))
        return top

    def vllm_prompt_logprobs(self, choice: Choice) -> list:
        """vLLM's shape: per prompt token, None for the first, else {id: {logprob, rank,
        decoded_token}} for the token and its alternatives."""
        body: list = [None]
        for entry in choice.prompt_logprobs:
            ranked = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                ranked.setdefault(token_id, (logprob, rank))
            body.append({str(token_id): {"logprob": _finite(logprob), "rank": rank,
                                         "decoded_token": self.token_text(token_id)}
                         for token_id, (logprob, rank) in ranked.items()})
        return body


def returned_choices(choices: list[Choice], completion: Completion) -> list[Choice]:
    """The n choices answered per prompt: all of them, or the best_of most likely (by their
    tokens' summed log probabilities), renumbered prompt by prompt."""
    returned = []
    for prompt_index in range(max(len(completion.prompts), 1)):
        group = choices[prompt_index * completion.best_of:(prompt_index + 1) * completion.best_of]
        if completion.best_of > completion.n:
            group = sorted(group, key=lambda choice: choice.cumulative_logprob, reverse=True)
        for rank, choice in enumerate(group[:completion.n]):
            choice.index = prompt_index * completion.n + rank
            returned.append(choice)
    return returned


def total_usage(choices: list[Choice], completion: Completion) -> Usage:
    """Every generation's tokens, each prompt's counted once."""
    usages = [choice.last.usage or Usage() for choice in choices]
    per_prompt = completion.best_of
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages[::per_prompt]),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_prompt_tokens=sum(u.cached_prompt_tokens for u in usages[::per_prompt]))


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               502: "server_error", 503: "service_unavailable", 504: "timeout"}
ERROR_CODES = {401: "invalid_api_key", 409: "duplicate_request_id", 413: "request_too_large",
               429: "overloaded", 503: "unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param or None, "code": code or ERROR_CODES.get(status)}}
