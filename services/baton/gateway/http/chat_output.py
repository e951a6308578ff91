"""One chat choice's generated text as OpenAI's assistant message: the reasoning split off
into ``reasoning_content`` (templates that think), tool calls read out of the rest (the
format the request's tools were offered in, or the JSON a required call was forced into).

Whole (``message``) or delta by delta (``feed``/``finish``): the same reading, so a stream's
deltas add up to the whole message. A choice that called tools and stopped ends with
finish_reason "tool_calls", as OpenAI's does.
"""

from __future__ import annotations

from baton.gateway.http.reasoning import ReasoningSplitter, reasoning_splitter
from baton.gateway.http.tool_choice import ToolRequest, forced_parser
from baton.gateway.http.tool_parsers import StreamingToolParser, detect_parser, parser_for


class ChatOutput:
    def __init__(self, splitter: ReasoningSplitter | None, parser: StreamingToolParser | None) -> None:
        self.splitter = splitter
        self.parser = parser

    @classmethod
    def for_request(cls, tools: ToolRequest | None, template_source: str | None, prompt_text: str,
                    template_kwargs: dict, parser_name: str = "") -> ChatOutput:
        """``parser_name``: the deployment's tool call format; empty = the template's."""
        parser = None
        if tools is not None and tools.forced:
            parser = forced_parser(tools.tool_choice)
        elif tools is not None and tools.tool_choice == "auto":
            name = parser_name or detect_parser(template_source)
            parser = parser_for(name)() if name else None
        return cls(reasoning_splitter(template_source, prompt_text, template_kwargs), parser)

    @property
    def plain(self) -> bool:
        """Nothing to read out: the text is the content as it comes."""
        return self.splitter is None and self.parser is None

    def message(self, text: str) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if self.splitter is not None:
            reasoning, text = self.splitter.split(text)
            message["content"] = text
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if self.parser is not None:
            parsed = self.parser.parse_whole(text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message

    def feed(self, text: str) -> list[dict]:
        return self._route(self.splitter.feed(text) if self.splitter else [{"content": text}])

    def finish(self) -> list[dict]:
        deltas = self._route(self.splitter.finish()) if self.splitter else []
        if self.parser is not None:
            deltas += self.parser.finish()
        return deltas

    def finish_reason(self, reason: str, called: bool | None = None) -> str:
        """OpenAI's "tool_calls" for a choice that called and stopped."""
        if called is None:
            called = bool(self.parser and self.parser.tool_calls)
        return "tool_calls" if called and reason == "stop" else reason

    def _route(self, deltas: list[dict]) -> list[dict]:
        if self.parser is None:
            return deltas
        routed = []
        for delta in deltas:
            routed += self.parser.feed(delta["content"]) if "content" in delta else [delta]
        return routed
