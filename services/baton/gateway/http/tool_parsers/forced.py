"""Calls a JSON schema forced the model to write (``tool_choice`` "required", or a named
function): no format's markers, only JSON. "required" makes the output a list of
``{"name": ..., "parameters": {...}}``; a named function makes it that function's
arguments. Read like the formats, whole or streamed, the arguments as written."""

from __future__ import annotations

import re

from baton.gateway.http.tool_parsers.base import StreamingToolParser
from baton.gateway.http.tool_parsers.json_calls import ArgumentsObject, CallList

_SPACE = re.compile(r"\s*")


class _ForcedParser(StreamingToolParser):
    """The output is one JSON value (after whitespace); what follows it is content, as is
    the value when it is malformed."""

    def __init__(self) -> None:
        super().__init__()
        self._value = None

    def _read_value(self, pos: int):
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        text = self._text
        if self._state == "outside":
            pos = _SPACE.match(text, self._pos).end()
            if pos == len(text):
                return False
            self._value = self._read_value(pos)
            self._state = "value" if self._value else "text"
        elif self._state == "value":
            end = self._read_call(self._value, final)
            if end is None:
                return False
            self._state = "text"
        else:
            if len(text) > self._pos:
                self._send_content(len(text))
            return False
        return True


class RequiredCallsParser(_ForcedParser):
    """tool_choice "required": a list of calls."""

    name = "required"

    def _read_value(self, pos: int) -> CallList | None:
        return CallList(pos) if self._text[pos] == "[" else None


class NamedCallParser(_ForcedParser):
    """tool_choice naming a function: the output is its arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self._function_name = function_name

    def _read_value(self, pos: int) -> ArgumentsObject | None:
        return ArgumentsObject(self._function_name, pos) if self._text[pos] == "{" else None
