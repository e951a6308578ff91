"""What a chat request says about tools: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (or OpenAI's older ``functions`` and ``function_call``), checked,
each error naming its field, and made one shape; the JSON schema that forces the model to
call when the request requires a call (as vLLM builds it); and the calls read back from the
output that schema forced.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from baton.gateway.http.fields import BadParameter, short
from baton.gateway.http.tool_parsers.base import StreamingToolParser, ToolCall
from baton.gateway.http.tool_parsers.forced import NamedCallParser, RequiredCallsParser

TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for a function's name, and the dot that MCP servers' names use.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, checked. ``tool_choice``: "none", "auto", "required" or
    ``{"type": "function", "function": {"name": ...}}`` naming one of ``tools``."""

    tools: list[dict]  # [{"type": "function", "function": {"name", "parameters", ...}}]
    tool_choice: str | dict
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        """Whether the output must be calls (written as JSON a schema forces)."""
        return self.tool_choice not in ("none", "auto")

    def schema(self) -> dict | None:
        return tool_choice_schema(self.tools, self.tool_choice, self.parallel_tool_calls)


def validate_tools(tools: object = None, tool_choice: object = None,
                   parallel_tool_calls: object = None, *, functions: object = None,
                   function_call: object = None) -> ToolRequest:
    """The request's tools, checked; BadParameter naming the field at fault. ``functions``
    and ``function_call`` (deprecated by OpenAI) are read as ``tools`` and ``tool_choice``.
    ``tool_choice`` defaults to "auto" with tools, "none" without, as OpenAI's does."""
    if functions is not None:
        if tools is not None:
            raise BadParameter("functions", "give tools or functions, not both")
        tools = _legacy_functions(functions)
    if function_call is not None:
        if tool_choice is not None:
            raise BadParameter("function_call", "give tool_choice or function_call, not both")
        tool_choice = _legacy_choice(function_call)
    prefix = "functions" if functions is not None else "tools"
    checked = _tools(tools, prefix)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise BadParameter("parallel_tool_calls",
                           f"parallel_tool_calls must be true or false, got {short(parallel_tool_calls)}")
    choice = _tool_choice(tool_choice, checked, "function_call" if function_call is not None
                          else "tool_choice")
    return ToolRequest(checked, choice, parallel_tool_calls is not False)


def tool_choice_schema(tools: list[dict], tool_choice: str | dict,
                       parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema the output must follow: for "required", a list of 1 to n calls (1
    unless parallel) ``{"name": <a tool's name>, "parameters": <its schema>}``; for a named
    function, its parameters' schema. None for "none" and "auto" (the model chooses)."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return _required_schema(tools, parallel_tool_calls)
    function = _function_named(tools, tool_choice["function"]["name"])
    return copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)


def forced_parser(tool_choice: str | dict) -> StreamingToolParser | None:
    """The reader of the output ``tool_choice_schema`` forced; None when it forced nothing."""
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return RequiredCallsParser()
    return NamedCallParser(tool_choice["function"]["name"])


def tool_calls_from_forced_output(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """The calls in an output ``tool_choice_schema`` forced; none when it is not such an
    output (cut short by max_tokens), which the client then reads as content."""
    parser = forced_parser(tool_choice)
    return parser.parse_whole(text).tool_calls if parser else []


# --- checks ----------------------------------------------------------------------------------

def _tools(tools: object, prefix: str) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadParameter(prefix, f"{prefix} must be a list, got {short(tools)}")
    checked, seen = [], set()
    for index, tool in enumerate(tools):
        where = f"{prefix}[{index}]"
        if not isinstance(tool, dict):
            raise BadParameter(where, f"{where} must be an object, got {short(tool)}")
        if tool.get("type", "function") != "function":
            raise BadParameter(f"{where}.type", f"{where}.type must be \"function\", got "
                                                f"{short(tool.get('type'))}")
        function = _function(tool.get("function"), f"{where}.function")
        if function["name"] in seen:
            raise BadParameter(f"{where}.function.name",
                               f"{where}.function.name {function['name']!r} is given twice")
        seen.add(function["name"])
        checked.append({"type": "function", "function": function})
    return checked


def _function(function: object, where: str) -> dict:
    if not isinstance(function, dict):
        raise BadParameter(where, f"{where} must be an object, got {short(function)}")
    name = function.get("name")
    if name is None:
        raise BadParameter(f"{where}.name", f"{where}.name is missing")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise BadParameter(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, "
                                            f"'_', '-' or '.', got {short(name)}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadParameter(f"{where}.description", f"{where}.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadParameter(f"{where}.parameters", f"{where}.parameters must be a JSON schema "
                                                  f"object, got {short(parameters)}")
    return function


def _tool_choice(choice: object, tools: list[dict], field: str) -> str | dict:
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise BadParameter(field, f"{field} must be one of {', '.join(TOOL_CHOICES)} or "
                                      f"name a function, got {short(choice)}")
        if choice == "required" and not tools:
            raise BadParameter(field, f"{field} \"required\" needs tools to call; none are given")
        return choice
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(choice.get("function"), dict):
        raise BadParameter(field, f"{field} must be a string or {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}}, got {short(choice)}")
    name = choice["function"].get("name")
    if not isinstance(name, str):
        raise BadParameter(f"{field}.function.name", f"{field}.function.name must be a string")
    if not any(tool["function"]["name"] == name for tool in tools):
        known = ", ".join(tool["function"]["name"] for tool in tools) or "none given"
        raise BadParameter(f"{field}.function.name", f"{field}.function.name {name!r} is not "
                                                     f"among the tools ({known})")
    return {"type": "function", "function": {"name": name}}


def _legacy_functions(functions: object) -> list[dict]:
    if not isinstance(functions, list):
        raise BadParameter("functions", f"functions must be a list, got {short(functions)}")
    tools = []
    for index, function in enumerate(functions):
        tools.append({"type": "function", "function": _function(function, f"functions[{index}]")})
    return tools


def _legacy_choice(function_call: object) -> object:
    """``function_call``: "none", "auto" or {"name": ...}."""
    if isinstance(function_call, dict) and "name" in function_call:
        return {"type": "function", "function": {"name": function_call["name"]}}
    return function_call


# --- schemas ---------------------------------------------------------------------------------

def _function_named(tools: list[dict], name: str) -> dict:
    return next(tool["function"] for tool in tools if tool["function"]["name"] == name)


def _required_schema(tools: list[dict], parallel_tool_calls: bool) -> dict:
    """vLLM's: each item one tool's call; the tools' ``$defs`` lifted to the root, where
    their ``$ref``s now resolve."""
    definitions: dict[str, dict] = {}
    choices = []
    for tool in tools:
        parameters = copy.deepcopy(tool["function"].get("parameters") or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise BadParameter("tools", f"tools define $defs {name!r} twice, differently; "
                                            "tool_choice \"required\" needs one definition")
        choices.append({"properties": {"name": {"type": "string",
                                                "enum": [tool["function"]["name"]]},
                                       "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema
