"""A chat choice's text read into its message: reasoning split off, tool calls parsed, the
same whole and streamed, and "tool_calls" as the finish reason of a choice that called."""

from __future__ import annotations

import json
import random

from baton.gateway.http.chat_output import ChatOutput
from baton.gateway.http.tool_choice import validate_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>{{ tools }}<think>"
OUTPUT = ('<think>The user wants weather.</think>Let me look.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


def output_for(tool_choice: str = "auto") -> ChatOutput:
    tools = validate_tools(TOOLS, tool_choice)
    return ChatOutput.for_request(tools, HERMES_TEMPLATE, "prompt", {})


def test_the_whole_message_has_reasoning_content_and_tool_calls():
    output = output_for()
    message = output.message(OUTPUT)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me look."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert output.finish_reason("stop", called=True) == "tool_calls"
    assert output.finish_reason("length", called=True) == "length"


def test_streamed_deltas_add_up_to_the_whole_message():
    whole = output_for().message(OUTPUT)
    rng = random.Random(3)
    for _ in range(50):
        output = output_for()
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), 8))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)])]
        deltas = [d for piece in pieces for d in output.feed(piece)] + output.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        arguments = "".join(call["function"].get("arguments", "") for d in deltas
                            for call in d.get("tool_calls", []))
        assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
        assert arguments == whole["tool_calls"][0]["function"]["arguments"]
        assert output.finish_reason("stop") == "tool_calls"


def test_without_tools_or_thinking_the_text_is_the_content():
    output = ChatOutput.for_request(None, "{{ messages }}", "prompt", {})
    assert output.plain and output.message("hi") == {"role": "assistant", "content": "hi"}
    assert output.finish_reason("stop") == "stop"
