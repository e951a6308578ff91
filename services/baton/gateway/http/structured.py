"""The structure a request's output must take, from the fields clients send for it:
OpenAI's ``response_format`` (``json_object``, ``json_schema`` with its ``strict``), vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
``structured_outputs``. At most one may be given; each becomes a ``GrammarSpec`` that every
sampled token of the request follows, wherever it is drawn.
"""

from __future__ import annotations

import json

from baton.gateway.http.fields import BadParameter, short
from baton.gateway.http.values import json_object
from baton.sampling.grammar import GrammarError, GrammarSpec


def structured_output(body: dict) -> tuple[str, GrammarSpec] | None:
    """(the field that asked, the grammar) of OpenAI's ``response_format``, vLLM's
    ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
    ``structured_outputs``; at most one may be given. BadParameter names a bad one."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None and json_object(response_format, "response_format").get("type") != "text":
        asked.append(("response_format", lambda: _response_format(response_format)))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            value = body[name]
            asked.append((name, lambda kind=kind, value=value: _spec(kind, value)))
    if body.get("structured_outputs") is not None:
        asked.append(("structured_outputs", lambda: _structured_outputs(body["structured_outputs"])))
    if len(asked) > 1:
        raise BadParameter(asked[1][0], f"give one of {[name for name, _ in asked]}: each says "
                                        f"what the whole output must be")
    if not asked:
        return None
    name, read = asked[0]
    try:
        return name, read()
    except BadParameter:
        raise
    except ValueError as e:  # GrammarError: an invalid schema, regex or grammar
        raise BadParameter(name, f"{name}: {e}") from None


def _response_format(value: dict) -> GrammarSpec:
    kind = value.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        described = json_object(value.get("json_schema"), "response_format.json_schema")
        schema = described.get("schema", {})
        return GrammarSpec("json_schema", json.dumps(schema), strict=bool(described.get("strict")))
    raise BadParameter("response_format", f"response_format type {kind!r} is not one of "
                                          f"'text', 'json_object', 'json_schema'")


def _spec(kind: str, value: object) -> GrammarSpec:
    """vLLM's guided values: a schema as an object or its JSON text, choices as a list."""
    if kind in ("json_schema", "choice") and not isinstance(value, str):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise GrammarError(f"must be a string, got {short(value)}")
    return GrammarSpec(kind, value, strict=False)


def _structured_outputs(value: object) -> GrammarSpec:
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""
    value = json_object(value, "structured_outputs")
    given = {key: value[key] for key in ("json", "regex", "choice", "grammar", "json_object")
             if value.get(key) not in (None, False)}
    if len(given) != 1:
        raise BadParameter("structured_outputs", f"structured_outputs takes exactly one of json, "
                                                 f"regex, choice, grammar, json_object; got "
                                                 f"{sorted(given) or 'none'}")
    (key, spec), = given.items()
    if key == "json_object":
        return GrammarSpec("json_object")
    return _spec({"json": "json_schema"}.get(key, key), spec)
