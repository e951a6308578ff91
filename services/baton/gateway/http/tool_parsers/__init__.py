"""Tool calls in a model's output, in the formats of the families baton serves, whole or as
they stream; chosen by name (vLLM's ``--tool-call-parser`` names) or guessed from the chat
template that taught the model its format."""

from __future__ import annotations

from baton.gateway.http.tool_parsers.base import ParsedOutput, StreamingToolParser, ToolCall
from baton.gateway.http.tool_parsers.hermes import HermesToolParser
from baton.gateway.http.tool_parsers.llama3_json import Llama3JsonToolParser
from baton.gateway.http.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[StreamingToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
# What a template writes when it teaches a format, most telling first.
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                   ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def parser_for(name: str) -> type[StreamingToolParser]:
    """The parser named ``name``; ValueError naming the choices when there is none."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"no tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


def detect_parser(chat_template: str | None) -> str | None:
    """The name of the format a chat template teaches, None when it teaches none known."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return name
    return None


__all__ = ["PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParsedOutput", "StreamingToolParser", "ToolCall", "detect_parser", "parser_for"]
