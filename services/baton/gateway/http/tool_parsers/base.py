"""What every tool-call format shares: the call and result types, and the streaming reader
each format is written as.

A format is read one way whether the output arrives whole or in deltas: ``parse(text)`` is
the streaming reader fed the whole text at once, so a streamed answer and a whole one agree
by construction. The reader keeps the text generated so far and a position before which
everything is decided; each format's ``_step`` decides a little more (content, a call's
name, a fragment of its arguments) or waits for more text. A call's arguments are the JSON
text the model wrote, sliced from the output, never re-serialised: that is what lets their
fragments, concatenated, equal the whole call's arguments exactly.

When a call can be judged whole (its end is already in the text, as always when parsing
whole), a malformed one is left in the content. A call whose name was already streamed
before its end arrived stays a call: a stream cannot take back what it sent.

Whitespace that only separates text from a call (the newline before ``<tool_call>``, the
blank lines between calls) belongs to neither and is dropped.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

MALFORMED = -1  # what a call reader's advance() says of text that is no call

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    """One function call the model made; ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an assistant message's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """A whole output split into what the client reads and the calls it should make."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


class StreamingToolParser:
    """Reads one output, fed its text deltas, into OpenAI ``delta`` objects: ``{"content":
    ...}`` outside calls; for call ``i``, ``{"tool_calls": [{"index": i, "id", "type":
    "function", "function": {"name", "arguments": ""}}]}`` once, then ``{"tool_calls":
    [{"index": i, "function": {"arguments": fragment}}]}`` as its arguments arrive. Text that
    may be the start of a call marker is held back until it is known not to be. One parser
    per output; ``finish()`` once at its end."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self._text = ""  # the output so far
        self._pos = 0  # everything before it is decided
        self._state = "outside"
        self._deltas: list[dict] = []
        self._calls: list[ToolCall] = []
        self._held_space = ""  # content's trailing whitespace: sent once text follows it
        self._after_call = False  # whitespace after a call separates, and is dropped

    @classmethod
    def parse(cls, text: str) -> ParsedOutput:
        """A whole output; never raises (what is not a well-formed call stays content)."""
        return cls().parse_whole(text)

    def parse_whole(self, text: str) -> ParsedOutput:
        """The whole output, read by this parser (which must not have been fed)."""
        assert not self._text, "parse_whole reads a whole output, with a parser not yet fed"
        self._text = text
        self._advance(final=True)
        self._flush_held_space()
        content = "".join(delta["content"] for delta in self._take() if "content" in delta)
        return ParsedOutput(content or None, self.tool_calls)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far, arguments as sent so far."""
        return list(self._calls)

    def feed(self, text: str) -> list[dict]:
        self._text += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        """The held-back rest, the output having ended."""
        self._advance(final=True)
        self._flush_held_space()
        return self._take()

    # --- for the formats ---------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Decide what can be decided in the current state; False when waiting for text."""
        raise NotImplementedError

    def _new_id(self) -> str:
        return "call_" + random_id(24)

    def _send_content(self, end: int) -> None:
        """text[pos:end] is content."""
        piece, self._pos = self._text[self._pos:end], end
        if self._after_call:
            piece = piece.lstrip()
            if not piece:
                return
            self._after_call = False
        text = self._held_space + piece
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            self._deltas.append({"content": body})

    def _skip(self, end: int) -> None:
        """text[pos:end] is markup (a marker, a separator): sent as neither."""
        self._pos = end

    def _start_call(self, name: str, call_id: str | None = None) -> ToolCall:
        self._held_space = ""
        call = ToolCall(call_id or self._new_id(), name, "")
        self._calls.append(call)
        self._deltas.append({"tool_calls": [{"index": len(self._calls) - 1, "id": call.id,
                                             "type": "function",
                                             "function": {"name": name, "arguments": ""}}]})
        return call

    def _send_arguments(self, call: ToolCall, fragment: str) -> None:
        assert call is self._calls[-1], "arguments stream for the latest call only"
        if not fragment:
            return
        call.arguments += fragment
        self._deltas.append({"tool_calls": [{"index": len(self._calls) - 1,
                                             "function": {"arguments": fragment}}]})

    def _end_call(self, end: int) -> None:
        self._pos = end
        self._after_call = True

    def _read_call(self, reader, final: bool) -> int | bool | None:
        """Advance the call ``reader`` is reading: None while it waits for text; False when
        the text is no call (the rest of the output is then text); else the call's end, the
        call closed there."""
        end = reader.advance(self, self._text, final)
        if end is None:
            return None
        if end == MALFORMED:
            self._state = "text"
            return False
        self._end_call(end)
        return end

    def _send_content_until(self, marker: str, final: bool) -> int | None:
        """Send the content before ``marker``; its index when found, else None (having held
        back a tail that may be the marker's start)."""
        found = self._text.find(marker, self._pos)
        if found >= 0:
            self._send_content(found)
            return found
        end = len(self._text) if final else len(self._text) - partial_suffix(self._text, marker)
        if end > self._pos:
            self._send_content(end)
        return None

    # --- the loop ----------------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _flush_held_space(self) -> None:
        if self._held_space:
            self._deltas.append({"content": self._held_space})
            self._held_space = ""

    def _take(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (without being it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
