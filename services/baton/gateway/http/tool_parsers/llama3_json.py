"""Llama 3.x's JSON format: the output is the calls, each a JSON object, separated by
semicolons, optionally after the ``<|python_tag|>`` token::

    <|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}; {"name": ...}

Calls are only recognised at the start of the output (after whitespace), as Llama writes
them; an output that starts otherwise is all content. Text after the calls is content. A
malformed first call leaves the whole output as content.
"""

from __future__ import annotations

import re

from baton.gateway.http.tool_parsers.base import StreamingToolParser
from baton.gateway.http.tool_parsers.json_calls import CallObject

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_SPACE = re.compile(r"\s*")


class Llama3JsonToolParser(StreamingToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"
        self._cursor = 0  # where reading is, ahead of _pos while a call is undecided
        self._object: CallObject | None = None

    def _step(self, final: bool) -> bool:
        text = self._text
        if self._state == "text":
            if len(text) > self._pos:
                self._send_content(len(text))
            return False
        pos = _SPACE.match(text, self._cursor).end()
        if self._state in ("start", "before_object", "between") and pos == len(text):
            if not final:
                return False
            self._state = "text" if self._state != "between" else "done"
            return self._state == "text"
        if self._state == "start":
            if text.startswith(PYTHON_TAG, pos):
                self._cursor, self._state = pos + len(PYTHON_TAG), "before_object"
            elif text[pos] == "{":
                self._cursor, self._state = pos, "before_object"
            elif PYTHON_TAG.startswith(text[pos:]) and not final:
                return False
            else:
                self._state = "text"
        elif self._state == "before_object":
            if text[pos] == "{":
                self._object, self._state = CallObject(pos), "object"
            else:
                self._state = "text"
        elif self._state == "object":
            end = self._read_call(self._object, final)
            if end is None:
                return False
            if end is not False:
                self._cursor, self._state = end, "between"
        elif self._state == "between":
            if text[pos] == SEPARATOR:
                self._cursor, self._state = pos + 1, "before_object"
            else:
                self._state = "text"
        else:  # done
            return False
        return True
