"""OpenAI's request and response bodies, as baton's domain objects.

Requests: ``completion_request`` and ``chat_request`` read a JSON body into a ``Completion``
(the prompt, sampling, and how to answer). Every field is honoured, refused with a 400 that
names it when set to something baton cannot do, or ignored with a warning
(``baton.gateway.http.fields`` decides which). vLLM's extensions that benchmark tools send
(``top_k``, ``ignore_eos``, ``stop_token_ids``) are read too, and baton's own
``compression`` ({"enabled", "keep_ratio"}) and ``prefill_route`` ("auto", "chain",
"local"). Values go through the same checks as the gRPC API (``SamplingParams`` and the
gateway's prompt checks).

Responses: ``completion_body``/``chunk`` build the JSON OpenAI's clients parse, and
``error_body`` the ``{"error": {...}}`` of a failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton.api.requests import PREFILL_ROUTES, FinishReason, GenerationStep, Usage
from baton.gateway.http.fields import BadParameter, check_fields, short
from baton.model.sampling import CompressionParams, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORTED: "abort"}


@dataclass
class Completion:
    """One request read from a body: what to generate and how to answer it."""

    chat: bool
    model: str
    sampling: SamplingParams
    compression: CompressionParams
    stream: bool = False
    include_usage: bool = False
    text: str | None = None  # the prompt as text, or ...
    token_ids: tuple[int, ...] | None = None  # ... as token ids (completions only)
    messages: list[dict] = field(default_factory=list)  # chat: role/content, content as text
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # chat: the last message left open, to be continued
    chat_template: str | None = None  # chat: the request's own template, or a checkpoint's name
    template_kwargs: dict = field(default_factory=dict)  # chat: documents, chat_template_kwargs
    # the tokenizer's own additions (a Llama tokenizer's BOS): vLLM's defaults, on for a
    # completion's text prompt, off for chat (the template writes them)
    add_special_tokens: bool = True
    max_tokens: int | None = None  # None (chat only): up to the model's context
    return_token_ids: bool = False  # vLLM's extension: the generated ids beside the text
    prefill_route: str = "auto"  # baton's extension: pin the prefill to "chain" or "local"


def completion_request(body: object, defaults: dict | None = None) -> Completion:
    """A ``POST /v1/completions`` body; raises BadParameter naming the field. ``defaults``:
    the model's temperature, top_p and top_k for a body that leaves them out."""
    body = _object(body, "the request body")
    check_fields(body, "completions")
    text, token_ids = _prompt(body.get("prompt"))
    max_tokens = _integer(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=1)
    return Completion(chat=False, model=_model(body), text=text, token_ids=token_ids,
                      add_special_tokens=_boolean(body, "add_special_tokens", True),
                      sampling=_sampling(body, max_tokens, defaults), compression=_compression(body),
                      stream=_boolean(body, "stream", False),
                      include_usage=_include_usage(body), max_tokens=max_tokens,
                      return_token_ids=_boolean(body, "return_token_ids", False),
                      prefill_route=_prefill_route(body))


def chat_request(body: object, defaults: dict | None = None) -> Completion:
    """A ``POST /v1/chat/completions`` body; raises BadParameter naming the field."""
    body = _object(body, "the request body")
    check_fields(body, "chat")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadParameter("continue_final_message", "continue_final_message and "
                                                     "add_generation_prompt cannot both be true")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, limit, None, minimum=1)
    return Completion(chat=True, model=_model(body), messages=_messages(body.get("messages")),
                      add_generation_prompt=_boolean(body, "add_generation_prompt", True),
                      continue_final_message=_boolean(body, "continue_final_message", False),
                      chat_template=_optional_text(body, "chat_template"),
                      template_kwargs=_template_kwargs(body),
                      add_special_tokens=_boolean(body, "add_special_tokens", False),
                      sampling=_sampling(body, max_tokens or 1, defaults),
                      compression=_compression(body),
                      stream=_boolean(body, "stream", False),
                      include_usage=_include_usage(body), max_tokens=max_tokens,
                      return_token_ids=_boolean(body, "return_token_ids", False),
                      prefill_route=_prefill_route(body))


# --- reading fields --------------------------------------------------------------------------

def _object(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise BadParameter("", f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _model(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise BadParameter("model", f"model must be a string, got {model!r}")
    return model


def _prompt(prompt: object) -> tuple[str | None, tuple[int, ...] | None]:
    """A completions prompt: a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadParameter("prompt", "the prompt is empty")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadParameter("prompt", f"a list of {len(prompt)} prompts is not supported: send one "
                                     f"request per prompt")
    raise BadParameter("prompt", f"prompt must be a non-empty string or list of token ids, got "
                                 f"{short(prompt)}")


def _optional_text(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadParameter(name, f"{name} must be a string, got {short(value)}")
    return value or None


def _template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs`` and ``documents``: what the chat template reads besides the
    messages (vLLM's fields)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadParameter("chat_template_kwargs", f"chat_template_kwargs must be an object, got "
                                                   f"{short(kwargs)}")
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message"} & set(kwargs)
    if reserved:
        raise BadParameter("chat_template_kwargs", f"chat_template_kwargs may not set "
                                                   f"{sorted(reserved)}: they are fields of their own")
    documents = body.get("documents")
    if documents is not None:
        if not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            raise BadParameter("documents", f"documents must be a list of objects, got {short(documents)}")
        kwargs = {**kwargs, "documents": documents}
    return kwargs


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadParameter("messages", f"messages must be a non-empty list, got {short(messages)}")
    read = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadParameter("messages", f"messages[{index}] must be an object, got {short(message)}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise BadParameter("messages", f"messages[{index}].role {role!r} is not one of {CHAT_ROLES}")
        # what a template reads besides the text: an assistant's tool calls and reasoning, a
        # tool result's call id and name
        kept = {key: message[key] for key in MESSAGE_KEYS if message.get(key) is not None}
        read.append({**kept, "role": role, "content": _content(message.get("content"), index)})
    return read


def _content(content: object, index: int) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadParameter("messages", f"messages[{index}].content has a part "
                                               f"{short(part)}; only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise BadParameter("messages", f"messages[{index}].content must be a string or a list of "
                                   f"text parts, got {short(content)}")


def _sampling(body: dict, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
    defaults = defaults or {}
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadParameter("stop", f"stop must be a string or a list of strings, got {short(stop)}")
    stop_token_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_token_ids, list) and all(_is_int(t) for t in stop_token_ids)):
        raise BadParameter("stop_token_ids", f"stop_token_ids must be a list of integers, got "
                                             f"{short(stop_token_ids)}")
    top_k = _integer(body, "top_k", defaults.get("top_k", 0), minimum=-1)
    try:
        return SamplingParams(temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
                              top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
                              top_k=max(top_k, 0),
                              seed=_integer(body, "seed", None), max_tokens=max_tokens,
                              stop=stop, stop_token_ids=stop_token_ids,
                              ignore_eos=_boolean(body, "ignore_eos", False))
    except BadParameter:
        raise
    except ValueError as e:  # the shared checks name the value; find the field they mean
        names = [name for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop",
                                   "stop_token_ids") if name in str(e)]
        raise BadParameter(names[0] if names else "", str(e)) from None


def _compression(body: dict) -> CompressionParams:
    compression = body.get("compression")
    if compression is None:
        return CompressionParams()
    compression = _object(compression, "compression")
    enabled = compression.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise BadParameter("compression", f"compression.enabled must be true or false, got {enabled!r}")
    keep_ratio = compression.get("keep_ratio")
    if keep_ratio is not None and not _is_number(keep_ratio):
        raise BadParameter("compression", f"compression.keep_ratio must be a number, got {keep_ratio!r}")
    try:
        return CompressionParams(enabled=enabled, keep_ratio=keep_ratio)
    except ValueError as e:
        raise BadParameter("compression", str(e)) from None


def _prefill_route(body: dict) -> str:
    route = body.get("prefill_route") or "auto"
    if route not in PREFILL_ROUTES:
        raise BadParameter("prefill_route", f"prefill_route {route!r} is not one of {PREFILL_ROUTES}")
    return route


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    return _boolean(_object(options, "stream_options"), "include_usage", False)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(body: dict, name: str, default, minimum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise BadParameter(name, f"{name} must be an integer, got {short(value)}")
    if minimum is not None and value < minimum:
        raise BadParameter(name, f"{name} must be >= {minimum}, got {value}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not math.isfinite(value):
        raise BadParameter(name, f"{name} must be a finite number, got {short(value)}")
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParameter(name, f"{name} must be true or false, got {short(value)}")
    return value


# --- answers ---------------------------------------------------------------------------------

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


@dataclass
class Answer:
    """How one request is answered: its ids and the shape of its JSON."""

    chat: bool
    response_id: str
    model: str
    created: int

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model}

    def whole(self, text: str, last: GenerationStep, token_ids: list[int] | None = None) -> dict:
        """The non-streaming response (``token_ids`` when asked for)."""
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH_REASONS[last.finish_reason]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head(self.object), "choices": [choice], "usage": usage_body(last.usage),
                "baton": baton_body(self.response_id, last)}

    def chunk(self, text: str | None, finish_reason: FinishReason | None, include_usage: bool,
              role: bool = False, token_ids: tuple[int, ...] | None = None) -> dict:
        """One streamed chunk: ``text`` (None: no content, e.g. the chat's last chunk), the
        finish reason on the last; ``role`` on a chat stream's first; ``token_ids`` when
        asked for."""
        choice = {"index": 0, "logprobs": None,
                  "finish_reason": FINISH_REASONS[finish_reason] if finish_reason else None}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
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

    def usage_chunk(self, last: GenerationStep) -> dict:
        """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return {**self._head(f"{self.object}.chunk" if self.chat else self.object), "choices": [],
                "usage": usage_body(last.usage), "baton": baton_body(self.response_id, last)}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               502: "server_error", 503: "service_unavailable", 504: "timeout"}
ERROR_CODES = {401: "invalid_api_key", 409: "duplicate_request_id", 413: "request_too_large",
               429: "overloaded", 503: "unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param or None, "code": code or ERROR_CODES.get(status)}}
