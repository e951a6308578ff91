"""Chat templates render as transformers renders them (its own renderer, on the same
inputs): tojson without HTML escaping and with its keywords, strftime_now, namespace, the
{% generation %} tag, tools, documents, extra keywords (enable_thinking), the special tokens,
raise_exception, and continue_final_message. The templates under chat_templates/ exercise
each of these in the shapes real checkpoints use them (Qwen's tools and thinking, Llama 3's
dates and documents, Mistral's alternation, Gemma's folded system turn and content
parts, Phi-3's role tags)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton.gateway.http.chat_template import ChatTemplate, TemplateError
from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "sun & <rain>",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "Be brief <always> & kind."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": json.dumps({"sky": "clear"})},
        {"role": "user", "content": "Thanks"}]
ALTERNATING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
               {"role": "user", "content": "c"}]
CASES = [
    ("tools_and_thinking", CHAT, {"tools": TOOLS}),
    ("tools_and_thinking", CHAT, {"tools": TOOLS, "enable_thinking": False}),
    ("tools_and_thinking", CHAT[1:2] + [{"role": "assistant", "content": "It is"}], {}),
    ("dated_documents", ALTERNATING, {"documents": [{"title": "a<b>", "text": "ünïcode"}]}),
    ("mistral_style", ALTERNATING, {}),
    # a system turn folded into the first user turn, "model" for the assistant, content parts
    ("gemma_style", [{"role": "system", "content": "Be brief."}] + ALTERNATING, {}),
    ("gemma_style", [{"role": "user", "content": [{"type": "text", "text": " parts  "}]}], {}),
    ("phi3_style", [{"role": "system", "content": "Be brief."}] + ALTERNATING, {}),
]


def transformers_render(source: str, messages, add_generation_prompt=True, continue_final_message=False,
                        tools=None, documents=None, **kwargs) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=source, tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        **SPECIAL, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("name, messages, extra", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_template_renders_as_transformers_renders_it(name, messages, extra, add_generation_prompt):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    ours = ChatTemplate(source, SPECIAL).render(messages, add_generation_prompt, **extra)
    assert ours == transformers_render(source, messages, add_generation_prompt, **extra)
    assert "\\u00fc" not in ours and "&lt;" not in ours  # no ASCII or HTML escaping


def test_continue_final_message_leaves_the_last_message_open_as_transformers_does():
    source = (TEMPLATES / "tools_and_thinking.jinja").read_text()
    messages = [{"role": "user", "content": "Write a haiku"},
                {"role": "assistant", "content": "Autumn moonlight -"}]
    ours = ChatTemplate(source, SPECIAL).render(messages, False, continue_final_message=True)
    assert ours.endswith("Autumn moonlight -")
    assert ours == transformers_render(source, messages, False, continue_final_message=True)


def test_a_template_that_refuses_the_conversation_says_why():
    source = (TEMPLATES / "mistral_style.jinja").read_text()
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate(source, SPECIAL).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(TemplateError, match="not valid Jinja"):
        ChatTemplate(source, SPECIAL).render(ALTERNATING, template="{% if %}")
