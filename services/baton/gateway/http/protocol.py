"""OpenAI's request and response bodies, as baton's domain objects.

Requests: ``completion_request`` and ``chat_request`` read a JSON body into a ``Completion``
(the prompt, sampling, and how to answer). Every field is honoured, refused with a 400 that
names it when set to something baton cannot do, or ignored with a warning
(``baton.gateway.http.fields`` decides which). vLLM's extensions that benchmark tools send
(``top_k``, ``ignore_eos``, ``stop_token_ids``) are read too, and baton's own
``compression`` ({"enabled", "keep_ratio"}) and ``prefill_route`` ("auto", "chain",
"local"). Values go through the same checks as the gRPC API (``SamplingParams`` and the
gateway's prompt checks).

Answers are built in ``baton.gateway.http.answers``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from baton.gateway.http.fields import BadParameter, check_fields, short
from baton.gateway.http.sampling_fields import compression_params, prefill_route, sampling_params
from baton.gateway.http.structured import structured_output
from baton.gateway.http.tool_choice import ToolRequest, validate_tools
from baton.gateway.http.values import boolean, integer, is_int, json_object, optional_text, strings
from baton.sampling.grammar import GrammarSpec
from baton.sampling.params import MAX_LOGPROBS, CompressionParams, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")
MAX_CHOICES = 128  # n, best_of, and prompts x best_of in one request


@dataclass
class Completion:
    """One request read from a body: what to generate and how to answer it."""

    chat: bool
    model: str
    sampling: SamplingParams
    compression: CompressionParams
    stream: bool = False
    include_usage: bool = False
    # completions: each prompt as text or as token ids (choices: prompt by prompt, n each)
    prompts: list[str | tuple[int, ...]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # chat: role/content, content as text
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # chat: the last message left open, to be continued
    chat_template: str | None = None  # chat: the request's own template, or a checkpoint's name
    template_kwargs: dict = field(default_factory=dict)  # chat: documents, chat_template_kwargs
    # the tokenizer's own additions (a Llama tokenizer's BOS): vLLM's defaults, on for a
    # completion's text prompt, off for chat (the template writes them)
    add_special_tokens: bool = True
    max_tokens: int | None = None  # None (chat only): up to the model's context; 0: echo only
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # choices generated per prompt, the n most likely returned
    echo: bool = False  # completions: the prompt before its completion (and its logprobs)
    logprobs: int | None = None  # alternatives reported per token (None: no log probabilities)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's, beside the choices
    bad_words: list[str] = field(default_factory=list)  # tokenized with the prompt
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens
    cache_salt: str = ""
    tools: ToolRequest | None = None  # chat: the tools offered, and how the model must use them
    structured_field: str = ""  # the field that asked for sampling.structured
    return_token_ids: bool = False  # vLLM's extension: the generated ids beside the text
    prefill_route: str = "auto"  # baton's extension: pin the prefill to "chain" or "local"


def completion_request(body: object, defaults: dict | None = None) -> Completion:
    """A ``POST /v1/completions`` body; raises BadParameter naming the field. ``defaults``:
    the model's temperature, top_p and top_k for a body that leaves them out."""
    body = json_object(body, "the request body")
    check_fields(body, "completions")
    prompts = _prompts(body.get("prompt"))
    echo = boolean(body, "echo", False)
    max_tokens = integer(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=0)
    if max_tokens == 0 and not echo:
        raise BadParameter("max_tokens", "max_tokens 0 generates nothing: it is taken only with "
                                         "echo (the prompt's log probabilities)")
    logprobs = integer(body, "logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    prompt_logprobs = _prompt_logprobs(body, logprobs if echo else None)
    completion = Completion(
        chat=False, model=_model(body), prompts=prompts,
        add_special_tokens=boolean(body, "add_special_tokens", True),
        sampling=sampling_params(body, max(max_tokens, 1), defaults, logprobs, prompt_logprobs),
        echo=echo, logprobs=logprobs, prompt_logprobs=integer(body, "prompt_logprobs", None),
        max_tokens=max_tokens, **_common(body))
    _check_choices(completion)
    return _constrained(completion, body)


def chat_request(body: object, defaults: dict | None = None) -> Completion:
    """A ``POST /v1/chat/completions`` body; raises BadParameter naming the field."""
    body = json_object(body, "the request body")
    check_fields(body, "chat")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadParameter("continue_final_message", "continue_final_message and "
                                                     "add_generation_prompt cannot both be true")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, limit, None, minimum=1)
    logprobs = None
    if boolean(body, "logprobs", False):
        logprobs = integer(body, "top_logprobs", 0, minimum=0, maximum=MAX_LOGPROBS)
    elif body.get("top_logprobs"):
        raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
    prompt_logprobs = _prompt_logprobs(body, None)
    tools = validate_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                           functions=body.get("functions"), function_call=body.get("function_call"))
    completion = Completion(
        chat=True, tools=tools if tools.tools else None, model=_model(body), messages=_messages(body.get("messages")),
        add_generation_prompt=boolean(body, "add_generation_prompt", True),
        continue_final_message=boolean(body, "continue_final_message", False),
        chat_template=optional_text(body, "chat_template"),
        template_kwargs=_template_kwargs(body),
        add_special_tokens=boolean(body, "add_special_tokens", False),
        sampling=sampling_params(body, max_tokens or 1, defaults, logprobs, prompt_logprobs),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, max_tokens=max_tokens, **_common(body))
    _check_choices(completion)
    return _constrained(completion, body)


def _constrained(completion: Completion, body: dict) -> Completion:
    """The completion with the structure its output must take, if it asks for one."""
    named = structured_output(body)
    tools = completion.tools
    if tools is not None and tools.forced:
        if named is not None:
            raise BadParameter(named[0], f"{named[0]} cannot be combined with a tool_choice that "
                                         f"forces a call")
        named = ("tool_choice", GrammarSpec("json_schema", json.dumps(tools.schema()), strict=False))
    if named is None:
        return completion
    return dataclasses.replace(completion, structured_field=named[0], sampling=dataclasses.replace(
        completion.sampling, structured=named[1]))


def _common(body: dict) -> dict:
    """The fields both endpoints read alike, as ``Completion`` keywords."""
    n = integer(body, "n", 1, minimum=1, maximum=MAX_CHOICES)
    truncate = integer(body, "truncate_prompt_tokens", None, minimum=1)
    return {"compression": compression_params(body), "stream": boolean(body, "stream", False),
            "include_usage": _include_usage(body),
            "return_token_ids": boolean(body, "return_token_ids", False),
            "prefill_route": prefill_route(body), "n": n,
            "best_of": integer(body, "best_of", n, minimum=1, maximum=MAX_CHOICES),
            "bad_words": strings(body, "bad_words"), "truncate_prompt_tokens": truncate,
            "cache_salt": optional_text(body, "cache_salt") or ""}


def _check_choices(completion: Completion) -> None:
    if completion.best_of < completion.n:
        raise BadParameter("best_of", f"best_of {completion.best_of} must be >= n {completion.n}")
    if completion.best_of > completion.n and completion.stream:
        raise BadParameter("best_of", "best_of > n cannot stream: the best choices are known "
                                      "only at the end")
    total = completion.best_of * max(len(completion.prompts), 1)
    if total > MAX_CHOICES:
        raise BadParameter("best_of" if completion.best_of > completion.n else "n",
                           f"{total} generations in one request (prompts x best_of); at most "
                           f"{MAX_CHOICES}")


def _prompt_logprobs(body: dict, echoed: int | None) -> int | None:
    """vLLM's ``prompt_logprobs``, or a completion's ``logprobs`` when it echoes the prompt."""
    asked = integer(body, "prompt_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if asked is None:
        return echoed
    return asked if echoed is None else max(asked, echoed)


# --- reading fields --------------------------------------------------------------------------

def _model(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise BadParameter("model", f"model must be a string, got {model!r}")
    return model


def _prompts(prompt: object) -> list[str | tuple[int, ...]]:
    """A completions prompt: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(is_int(token) for token in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadParameter("prompt", f"prompt must be a non-empty string or list of token ids, "
                                     f"or a list of them, got {short(prompt)}")
    prompts: list[str | tuple[int, ...]] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str) and item:
            prompts.append(item)
        elif isinstance(item, list) and item and all(is_int(token) for token in item):
            prompts.append(tuple(item))
        else:
            where = "prompt" if len(prompt) == 1 else f"prompt[{index}]"
            raise BadParameter("prompt", f"{where} must be a non-empty string or list of token "
                                         f"ids, got {short(item)}")
    return prompts


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


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    return boolean(json_object(options, "stream_options"), "include_usage", False)


