"""A thinking model's reasoning, split from its answer: ``reasoning_content`` and ``content``.

Models taught by templates like Qwen 3's and DeepSeek-R1's think between ``<think>`` and
``</think>`` before answering. Some templates open ``<think>`` in the prompt themselves
(DeepSeek-R1's, Qwen3's thinking-only releases), so the output starts inside the reasoning
and only closes it; others leave the model to open it. An output that does not open with
``<think>`` (when the prompt did not) is all answer; one whose reasoning never closes (cut
short) is all reasoning. Whitespace between the reasoning and the answer is dropped. With
``enable_thinking`` false the template shuts the model's thinking, and nothing is split.

Whole or streamed, one splitter reads one output: ``split(text)`` is the stream fed whole,
so the two agree.
"""

from __future__ import annotations

from baton.gateway.http.tool_parsers.base import partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


def reasoning_splitter(chat_template: str | None, prompt: str,
                       template_kwargs: dict | None = None) -> ReasoningSplitter | None:
    """The splitter for an output of ``prompt``, rendered by ``chat_template``; None when
    the template does not think or the request turned thinking off."""
    if not chat_template or THINK_START not in chat_template:
        return None
    if (template_kwargs or {}).get("enable_thinking") is False:
        return None
    return ReasoningSplitter(starts_inside=prompt.rstrip().endswith(THINK_START))


class ReasoningSplitter:
    """Fed an output's text deltas, yields OpenAI ``delta`` objects, ``{"reasoning_content":
    ...}`` and ``{"content": ...}``, holding back what may be the start of a tag.
    ``starts_inside``: the prompt opened the reasoning."""

    def __init__(self, starts_inside: bool = False) -> None:
        self.starts_inside = starts_inside
        self._text = ""
        self._pos = 0
        self._state = "opening"  # the output has yet to show whether it opens a reasoning
        self._deltas: list[dict] = []

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output, reasoning None when there is none; with a
        splitter not yet fed."""
        assert not self._text, "split reads a whole output, with a splitter not yet fed"
        self._text = text
        self._advance(final=True)
        deltas = self._take()
        reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
        return reasoning or None, "".join(delta.get("content", "") for delta in deltas)

    def feed(self, text: str) -> list[dict]:
        self._text += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._advance(final=True)
        return self._take()

    def _advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        text = self._text
        if self._state == "opening":
            start = len(text) - len(text[self._pos:].lstrip())
            if text.startswith(THINK_START, start):
                self._pos, self._state = start + len(THINK_START), "reasoning"
            elif not final and THINK_START.startswith(text[start:]):
                return False  # whitespace or a tag's start so far
            else:
                self._state = "reasoning" if self.starts_inside else "answer"
            return True
        if self._state == "reasoning":
            found = text.find(THINK_END, self._pos)
            if found < 0:
                end = len(text) if final else len(text) - partial_suffix(text, THINK_END)
                self._send("reasoning_content", end)
                return False
            self._send("reasoning_content", found)
            self._pos, self._state = found + len(THINK_END), "after_reasoning"
            return True
        if self._state == "after_reasoning":  # the whitespace before the answer
            start = len(text) - len(text[self._pos:].lstrip())
            if start == len(text):
                return False
            self._pos, self._state = start, "answer"
            return True
        self._send("content", len(text))
        return False

    def _send(self, key: str, end: int) -> None:
        if end > self._pos:
            self._deltas.append({key: self._text[self._pos:end]})
            self._pos = end

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas
