"""Hermes' format, which Qwen 2.5 and Qwen 3 use: each call a JSON object between tags,
several in a row, text before them::

    Let me look.
    <tool_call>
    {"name": "weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call left open at the end of the output (no closing tag) is still a call when its JSON is
whole. A malformed call stays in the content, tags and all.
"""

from __future__ import annotations

import re

from baton.gateway.http.tool_parsers.base import MALFORMED, StreamingToolParser
from baton.gateway.http.tool_parsers.json_calls import CallObject

START, END = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")


class HermesToolParser(StreamingToolParser):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._call_start = 0  # where the current call's opening tag is
        self._object: CallObject | None = None

    def _step(self, final: bool) -> bool:
        text = self._text
        if self._state == "outside":
            found = self._send_content_until(START, final)
            if found is None:
                return False
            self._call_start, self._state = found, "before_object"
        elif self._state == "before_object":
            body = _SPACE.match(text, self._call_start + len(START)).end()
            if body == len(text) and not final:
                return False
            if body < len(text) and text[body] == "{":
                self._object, self._state = CallObject(body), "object"
            else:
                self._state = "malformed"
        elif self._state == "object":
            end = self._object.advance(self, text, final)
            if end is None:
                return False
            if end == MALFORMED:
                self._state = "malformed"
            else:
                self._pos, self._state = end, "after_object"
        elif self._state == "after_object":
            return self._skip_to_close(final)
        elif self._state == "malformed":
            return self._send_malformed(final)
        return True

    def _skip_to_close(self, final: bool) -> bool:
        """Past the closing tag, or up to the next call when this one was left open."""
        end = _first_end(self._text, self._pos)
        if end is None:
            if final:
                self._end_call(len(self._text))
            return False
        self._end_call(end)
        self._state = "outside"
        return True

    def _send_malformed(self, final: bool) -> bool:
        """The call's text, tags and all, is content."""
        end = _first_end(self._text, self._call_start + len(START))
        if end is None:
            if not final:
                return False
            end = len(self._text)
        self._send_content(end)
        self._state = "outside"
        return True


def _first_end(text: str, start: int) -> int | None:
    """Past the first closing tag after ``start``, or at the next opening tag if that comes
    first."""
    close, reopen = text.find(END, start), text.find(START, start)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close + len(END)
    return reopen if reopen >= 0 else None
