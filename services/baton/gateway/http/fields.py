"""What the OpenAI door does with every field a client sends: honoured, refused with a 400
that names it, or ignored with a warning (once per field name and process). Nothing is
dropped silently. The table is the one place this is decided (docs/architecture.md, "The
OpenAI HTTP API", renders it for readers).
"""

from __future__ import annotations

import logging
from typing import Any

from baton.errors import InvalidArgument

log = logging.getLogger(__name__)


class BadParameter(InvalidArgument):
    """A request field with a value baton cannot take; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# Read by the request parsers (baton.gateway.http.protocol), on both endpoints.
HONOURED_BOTH = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                 "allowed_token_ids", "bad_words", "n", "best_of", "prompt_logprobs",
                 "skip_special_tokens", "truncate_prompt_tokens", "cache_salt", "priority", "stream",
                 "response_format", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "structured_outputs",
                 "stream_options", "return_token_ids", "compression", "prefill_route",
                 "add_special_tokens"}
HONOURED = {
    "completions": HONOURED_BOTH | {"prompt", "echo", "logprobs"},
    "chat": HONOURED_BOTH | {"messages", "add_generation_prompt", "max_completion_tokens",
                             "continue_final_message", "chat_template", "chat_template_kwargs",
                             "documents", "logprobs", "top_logprobs", "tools", "tool_choice",
                             "parallel_tool_calls", "functions", "function_call"},
}
# Fields OpenAI or vLLM document that baton takes only at their neutral value (what a client
# that does not use them sends): any other value is refused, never silently ignored.
_NEUTRAL_BOTH: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "spaces_between_special_tokens": (None, True),
}
NEUTRAL = {
    "completions": {**_NEUTRAL_BOTH, "suffix": (None, "")},
    "chat": {**_NEUTRAL_BOTH, "reasoning_effort": (None,)},
}
# Documented, and without effect on what is generated: accepted, with a warning.
IGNORED = {"guided_decoding_backend", "user", "metadata", "store", "service_tier", "request_id", "modalities", "audio",
           "prediction", "web_search_options", "echo_prompt", "mm_processor_kwargs", "kv_transfer_params"}
_warned: set[str] = set()


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse a field set to what baton cannot do (BadParameter naming it); warn, once per
    name, of a field baton does not read."""
    honoured, neutral = HONOURED[endpoint], NEUTRAL[endpoint]
    for name, value in body.items():
        if name in honoured:
            continue
        if name in neutral:
            if value not in neutral[name]:
                accepted = " or ".join(repr(v) for v in neutral[name])
                raise BadParameter(name, f"{name} {short(value)} is not supported; baton takes "
                                         f"only {accepted}")
            continue
        if name not in _warned:
            _warned.add(name)
            why = "has no effect here" if name in IGNORED else "is not a field baton knows"
            log.warning("request field %r %s: ignored (this warning is given once)", name, why)


def short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
