"""A checkpoint's chat template: the conversation as the prompt text the model was trained on.

Read as Hugging Face stores it: ``chat_template.jinja`` beside the weights, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used; a request may name another, or bring its own). Rendered as
``transformers``' ``apply_chat_template`` renders it: Jinja2 in an immutable sandbox, blocks
trimmed, loop controls and the ``{% generation %}`` tag, its ``tojson`` (no HTML escaping),
``strftime_now``, ``raise_exception``, a guarded ``dict`` and ``namespace``; with
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special
tokens and any extra keyword (``chat_template_kwargs``). ``continue_final_message`` renders
the last message open, for the model to continue it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from baton.errors import InvalidArgument

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, cut off after rendering


class TemplateError(InvalidArgument):
    """The template refused the conversation (its ``raise_exception``), or failed on it."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    named: dict[str, str] = field(default_factory=dict)  # other templates by name

    @property
    def bos_token(self) -> str:
        return self.special_tokens.get("bos_token", "")

    @classmethod
    def from_dir(cls, directory: Path) -> ChatTemplate | None:
        """The checkpoint's template; None when it has none. Raises ValueError naming a
        template that is not valid Jinja."""
        config = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        jinja_path = directory / "chat_template.jinja"
        source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        named: dict[str, str] = {}
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        if not source:
            return None
        tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS if config.get(name)}
        template = cls(source, tokens, named)
        try:
            _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template of {directory} is not valid Jinja: {e}") from e
        return template

    def source_of(self, template: str | None = None) -> str:
        """The template a request renders with: its own (a name among the checkpoint's, or a
        source), else the checkpoint's."""
        return self.named.get(template, template) if template else self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *,
               tools: list[dict] | None = None, documents: list[dict] | None = None,
               continue_final_message: bool = False, template: str | None = None,
               **kwargs) -> str:
        """The prompt text of ``messages``; ``template``: a name among the checkpoint's, or a
        template's own source. Raises TemplateError (INVALID_ARGUMENT) when the template
        refuses them or cannot be compiled."""
        source = self.source_of(template)
        if continue_final_message:
            messages = _open_last(messages)
        try:
            text = _compile(source).render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template cannot render these messages: {e}") from e
        if continue_final_message:
            cut = text.rfind(CONTINUE_TAG.strip())
            if cut < 0:
                raise TemplateError("continue_final_message: the template dropped the final "
                                    "message, so it cannot be continued")
            text = text[:cut]
        return text


def _open_last(messages: list[dict]) -> list[dict]:
    """The messages with the last one's text marked where the rendering is cut."""
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise TemplateError("continue_final_message needs a final message with text content")
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain JSON, no HTML escaping (Jinja's own escapes <, >, &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` without attribute access to the class itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` refusing underscore names (no reach into Python's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with _: {name!r}")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: training templates mark the assistant's
    part; serving renders it as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                               dict=_TemplateDict(), namespace=_TemplateNamespace)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template is not valid Jinja: {e}") from e


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: text, or {"content": text}."""
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
