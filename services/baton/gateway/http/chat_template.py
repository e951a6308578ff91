"""A checkpoint's chat template: the conversation as the prompt text the model was trained on.

Read as Hugging Face stores it: ``chat_template.jinja`` beside the weights, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used). Rendered as ``transformers``' ``apply_chat_template`` renders it:
Jinja2 in an immutable sandbox, blocks trimmed, with ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and ``raise_exception``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from baton.errors import InvalidArgument


class TemplateError(InvalidArgument):
    """The template refused the conversation (its ``raise_exception``), or failed on it."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

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
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        if not source:
            return None
        template = cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
        try:
            template._compiled()
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template of {directory} is not valid Jinja: {e}") from e
        return template

    def _compiled(self) -> jinja2.Template:
        return _compile(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` ({"role", "content"} dicts); raises TemplateError
        (INVALID_ARGUMENT) when the template refuses them."""
        try:
            return self._compiled().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template cannot render these messages: {e}") from e


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: text, or {"content": text}."""
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
