"""Mistral's format: the ``[TOOL_CALLS]`` token, then either a JSON list of calls (older
tokenizers) or, per call, the function's name, ``[ARGS]`` and its arguments (tokenizers
from v11; v13 puts ``[CALL_ID]`` and the call's id between them)::

    [TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]weather[ARGS]{"city": "Paris"}[TOOL_CALLS]time[ARGS]{}

Text before the token is content. ``[TOOL_CALLS]`` is a special token: it reaches the text
only when the detokenizer keeps special tokens. Call ids are 9 letters and digits, the only
ids Mistral's chat templates accept back. What is malformed, and everything after it, stays
content.
"""

from __future__ import annotations

import re

from baton.gateway.http.tool_parsers.base import StreamingToolParser, random_id
from baton.gateway.http.tool_parsers.json_calls import ArgumentsObject, CallList

MARKER = "[TOOL_CALLS]"
MISTRAL_ID_LENGTH = 9
_SPACE = re.compile(r"\s*")
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]\s*")
_NAMED_SO_FAR = re.compile(r"[A-Za-z0-9_.\-\[\]]{0,256}")  # a named call's head, unfinished


class MistralToolParser(StreamingToolParser):
    name = "mistral"

    def __init__(self) -> None:
        super().__init__()
        self._cursor = 0
        self._calls_read: CallList | ArgumentsObject | None = None

    def _new_id(self) -> str:
        return random_id(MISTRAL_ID_LENGTH)

    def _step(self, final: bool) -> bool:
        text = self._text
        if self._state == "outside":
            found = self._send_content_until(MARKER, final)
            if found is None:
                return False
            self._cursor, self._state = found + len(MARKER), "after_marker"
        elif self._state == "after_marker":
            return self._read_head(final)
        elif self._state == "calls":
            end = self._read_call(self._calls_read, final)
            if end is None:
                return False
            if end is not False:
                self._state = "outside"
        else:  # text: everything from a malformed call on
            if len(text) > self._pos:
                self._send_content(len(text))
            return False
        return True

    def _read_head(self, final: bool) -> bool:
        """After the marker: a list's bracket, or a function's name and [ARGS]."""
        text = self._text
        pos = _SPACE.match(text, self._cursor).end()
        if pos == len(text) and not final:
            return False
        if pos < len(text) and text[pos] == "[":
            self._calls_read, self._state = CallList(pos), "calls"
            return True
        named = _NAMED.match(text, pos)
        if named and named.end() < len(text) and text[named.end()] == "{":
            self._calls_read = ArgumentsObject(named.group(1), named.end(), named.group(2))
            self._state = "calls"
            return True
        if not final and (named or _NAMED_SO_FAR.fullmatch(text, pos)):
            return False
        self._state = "text"
        return True
