"""A call written as a JSON object, ``{"name": ..., "arguments": {...}}``, read as it streams:
where a JSON value ends, and the call's name as soon as it is written, so that the
arguments can follow fragment by fragment."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from baton.gateway.http.tool_parsers.base import MALFORMED

if TYPE_CHECKING:
    from baton.gateway.http.tool_parsers.base import StreamingToolParser

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"
_SIGNIFICANT = re.compile(r'[{}\[\]"]')
_IN_STRING = re.compile(r'["\\]')
_SPACE = re.compile(r"\s*")
# The opening of a call whose name comes first and whose arguments are an object: enough
# to send the name and start streaming the arguments.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:'
                     r'\s*(?=\{)')
_DECODER = json.JSONDecoder()


class JsonEnd:
    """Where the JSON object or array opening at ``start`` ends (the index after its closing
    bracket), reading each character once however the text grows. Brackets are only
    counted, outside strings; ``json.loads`` judges the rest."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._in_string = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        pos = self._pos
        while self.end is None:
            if self._in_string:
                found = _IN_STRING.search(text, pos)
                if found is None:
                    pos = len(text)
                    break
                if found.group() == "\\":
                    if found.end() >= len(text):  # the escaped character has not arrived
                        pos = found.start()
                        break
                    pos = found.end() + 1
                    continue
                self._in_string, pos = False, found.end()
                continue
            found = _SIGNIFICANT.search(text, pos)
            if found is None:
                pos = len(text)
                break
            pos, mark = found.end(), found.group()
            if mark == '"':
                self._in_string = True
            elif mark in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self.end = pos
        self._pos = pos
        return self.end


class ArgumentsObject:
    """A call's arguments, the JSON object opening at ``start``, its name already read.
    Judged whole when its end is in the text; else the call is sent and its arguments
    stream as they arrive."""

    def __init__(self, name: str, start: int, call_id: str | None = None) -> None:
        self._name, self._call_id = name, call_id
        self._start = self._sent = start  # sent up to _sent
        self._scan = JsonEnd(start)
        self._call = None

    def advance(self, parser: StreamingToolParser, text: str, final: bool) -> int | None:
        """The arguments' end once read; None while waiting; MALFORMED when they are not
        an object."""
        end = self._scan.advance(text)
        if self._call is None:
            if end is None and final:
                return MALFORMED
            if end is not None and not isinstance(_json_or_none(text[self._start:end]), dict):
                return MALFORMED
            self._call = parser._start_call(self._name, self._call_id)
        sent_to = len(text) if end is None else end
        parser._send_arguments(self._call, text[self._sent:sent_to])
        self._sent = sent_to
        if end is None:
            return len(text) if final else None
        return end


class CallObject:
    """One call written as a JSON object, read from its opening brace. Judged whole when its
    end is in the text; streamed (the name, then the arguments as they arrive) when its
    name and the start of its arguments come before its end."""

    def __init__(self, start: int) -> None:
        self._start = start
        self._object = JsonEnd(start)
        self._arguments: ArgumentsObject | None = None

    def advance(self, parser: StreamingToolParser, text: str, final: bool) -> int | None:
        """The object's end once read; None while waiting; MALFORMED when it is no call."""
        end = self._object.advance(text)
        if self._arguments is None:
            if end is not None:
                call = call_from_object(text, self._start, end)
                if call is None:
                    return MALFORMED
                parser._send_arguments(parser._start_call(call[0]), call[1])
                return end
            header = _HEADER.match(text, self._start)
            name = _json_string(header.group(1)) if header else None
            if not name:
                return MALFORMED if final else None
            self._arguments = ArgumentsObject(name, header.end())
        arguments_end = self._arguments.advance(parser, text, final)
        if arguments_end is None or arguments_end == MALFORMED:
            return arguments_end
        if end is None:
            return len(text) if final else None
        return end


class CallList:
    """Calls written as a JSON list of call objects, read from its opening bracket."""

    def __init__(self, start: int) -> None:
        self._cursor = start + 1
        self._item: CallObject | None = None
        self._expect_item = True
        self._num_calls = 0

    def advance(self, parser: StreamingToolParser, text: str, final: bool) -> int | None:
        """The list's end once read; None while waiting; MALFORMED at what is no call (the
        calls before it stay)."""
        while True:
            if self._item is not None:
                end = self._item.advance(parser, text, final)
                if end is None or end == MALFORMED:
                    return end
                parser._end_call(end)
                self._item, self._cursor, self._expect_item = None, end, False
                self._num_calls += 1
            pos = _SPACE.match(text, self._cursor).end()
            if pos == len(text):
                if not final:
                    return None
                return pos if self._num_calls else MALFORMED  # cut short: keep what was read
            mark = text[pos]
            if mark == "]":
                return pos + 1
            if mark == "{" and self._expect_item:
                self._item = CallObject(pos)
            elif mark == "," and not self._expect_item:
                self._cursor, self._expect_item = pos + 1, True
            else:
                return MALFORMED


def call_from_object(text: str, start: int, end: int) -> tuple[str, str] | None:
    """(name, arguments) of the object text[start:end], the arguments as written; None when
    it is not a call (not JSON, no name, arguments not an object)."""
    try:
        value = json.loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in ARGUMENT_KEYS if key in value), None)
    if key is None:  # a function without parameters
        return value["name"], "{}"
    arguments = value[key]
    if isinstance(arguments, dict):
        span_start, span_end = member_spans(text, start)[key]
        return value["name"], text[span_start:span_end]
    if isinstance(arguments, str) and isinstance(_json_or_none(arguments), dict):
        return value["name"], arguments  # some models write the arguments as a JSON string
    return None


def member_spans(text: str, start: int) -> dict[str, tuple[int, int]]:
    """Where each member's value lies in the valid JSON object opening at ``start``."""
    spans = {}
    pos = _SPACE.match(text, start + 1).end()
    while text[pos] != "}":
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _SPACE.match(text, _SPACE.match(text, pos).end() + 1).end()  # past the colon
        _, value_end = _DECODER.raw_decode(text, pos)
        spans[key] = (pos, value_end)
        pos = _SPACE.match(text, value_end).end()
        if text[pos] == ",":
            pos = _SPACE.match(text, pos + 1).end()
    return spans


def _json_string(quoted: str) -> str | None:
    value = _json_or_none(quoted)
    return value if isinstance(value, str) else None


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
