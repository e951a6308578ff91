"""Tool calls read from a model's output in each family's format (Hermes/Qwen, Llama 3's
JSON, Mistral's two forms, and the JSON a forcing schema makes the model write): one and
several calls, text around them, malformed calls left as content, unicode and JSON's
awkward characters in the arguments; and streaming, which on any split of an output sends
the same content and the same calls, arguments fragment by fragment, as parsing it whole.
The request side: tools checked with errors naming the field, the forcing schemas checked
with jsonschema, and the format guessed from chat templates."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from baton.gateway.http.fields import BadParameter
from baton.gateway.http.tool_choice import (
    forced_parser,
    tool_calls_from_forced_output,
    tool_choice_schema,
    validate_tools,
)
from baton.gateway.http.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    detect_parser,
    parser_for,
)
from baton.gateway.http.tool_parsers.forced import NamedCallParser, RequiredCallsParser

TEMPLATES = Path(__file__).parent / "chat_templates"
# Arguments with what trips a naive reader: braces and brackets in strings, escaped quotes
# and backslashes, unicode written raw and escaped, nesting.
AWKWARD = '{"q": "a {b} [c] \\"d\\" \\\\", "city": "Zürich 🌧", "e": "\\u00e9", ' \
          '"nested": {"list": [1, {"x": "}"}], "empty": {}}}'
WEATHER = '{"city": "Paris", "unit": "celsius"}'


def hermes(*calls: tuple[str, str], before: str = "", after: str = "") -> str:
    body = "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
                     for name, arguments in calls)
    return before + body + after


def calls_of(parsed) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


def stream(parser, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed ``text`` cut at ``cuts``; the content and calls the deltas add up to."""
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [delta for piece in pieces for delta in parser.feed(piece)] + parser.finish()
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        if "content" in delta:
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        if "id" in call:  # a call's first delta: its id and name, before any arguments
            assert call["index"] == len(calls) and call["type"] == "function"
            calls.append([call["function"]["name"], call["function"]["arguments"]])
        else:
            assert call["index"] == len(calls) - 1 and set(call) == {"index", "function"}
            calls[-1][1] += call["function"]["arguments"]
    streamed = [tuple(call) for call in calls]
    assert streamed == [(call.name, call.arguments) for call in parser.tool_calls]
    return content or None, streamed, deltas


# --- Hermes ----------------------------------------------------------------------------------

def test_hermes_one_call_is_no_content():
    parsed = HermesToolParser.parse(hermes(("weather", WEATHER)))
    assert parsed.content is None
    assert calls_of(parsed) == [("weather", WEATHER)]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", parsed.tool_calls[0].id)
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}


def test_hermes_several_calls_with_text_around():
    text = hermes(("weather", WEATHER), ("time", "{}"), ("search", AWKWARD),
                  before="Let me look.\n\n", after="\n\nDone.")
    parsed = HermesToolParser.parse(text)
    assert parsed.content == "Let me look.Done."
    assert calls_of(parsed) == [("weather", WEATHER), ("time", "{}"), ("search", AWKWARD)]
    assert json.loads(parsed.tool_calls[2].arguments)["city"] == "Zürich 🌧"
    ids = {call.id for call in parsed.tool_calls}
    assert len(ids) == 3


def test_hermes_arguments_are_kept_as_written():
    # the model's own spacing and key order: what streams is what the call says
    text = '<tool_call>{"name":"f","arguments":{"b":1,"a" : [ 2 ]}}</tool_call>'
    assert calls_of(HermesToolParser.parse(text)) == [("f", '{"b":1,"a" : [ 2 ]}')]


@pytest.mark.parametrize("body", [
    'not json',
    '{"name": "f", "arguments": {"x": }}',
    '{"arguments": {"x": 1}}',
    '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": [1, 2]}',
    '{"name": "f", "arguments": "not an object"}',
    'f(x=1)',
])
def test_hermes_malformed_call_stays_content(body):
    text = f"Before <tool_call>{body}</tool_call> after"
    parsed = HermesToolParser.parse(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_hermes_malformed_call_beside_good_ones():
    text = hermes(("a", "{}")) + "\n<tool_call>{oops}</tool_call>\n" + hermes(("b", WEATHER))
    parsed = HermesToolParser.parse(text)
    assert calls_of(parsed) == [("a", "{}"), ("b", WEATHER)]
    assert parsed.content == "<tool_call>{oops}</tool_call>"


def test_hermes_lenient_shapes():
    # left open at the end; arguments as a JSON string; keys in another order; no arguments
    assert calls_of(HermesToolParser.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')) \
        == [("f", '{"x": 1}')]
    assert calls_of(HermesToolParser.parse(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')) == [("f", '{"x": 1}')]
    assert calls_of(HermesToolParser.parse(
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')) == [("f", '{"x": 1}')]
    assert calls_of(HermesToolParser.parse('<tool_call>{"name": "f"}</tool_call>')) == [("f", "{}")]


def test_hermes_text_like_a_tag_is_content():
    text = "a <tool b <tool_calls> c <tool_call"
    assert HermesToolParser.parse(text).content == text


def test_a_call_cut_short_is_content_whole_and_a_call_streamed():
    """A stream cannot take back a name it sent: the difference is in what it can know."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": "unfinish'
    assert HermesToolParser.parse(text).content == text
    content, calls, _ = stream(HermesToolParser(), text, [30, 40])
    assert content is None and calls == [("f", '{"x": "unfinish')]


# --- Llama 3 ---------------------------------------------------------------------------------

def test_llama_one_call():
    for text in (f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}',
                 f'{{"name": "weather", "parameters": {WEATHER}}}',
                 f' \n{{"name": "weather", "arguments": {WEATHER}}}'):
        parsed = Llama3JsonToolParser.parse(text)
        assert parsed.content is None and calls_of(parsed) == [("weather", WEATHER)]


def test_llama_several_calls_then_text():
    text = (f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}; '
            f'{{"name": "search", "parameters": {AWKWARD}}};{{"name": "time", "parameters": {{}}}}'
            "\n\nThat is all.")
    parsed = Llama3JsonToolParser.parse(text)
    assert calls_of(parsed) == [("weather", WEATHER), ("search", AWKWARD), ("time", "{}")]
    assert parsed.content == "That is all."


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"answer": 42}',
    '<|python_tag|>brave_search.call(query="weather")',
    '{"name": "f", "parameters": {"x": ]}}',
    'Sure: {"name": "f", "parameters": {}}',  # calls only open the output
])
def test_llama_other_outputs_are_content(text):
    parsed = Llama3JsonToolParser.parse(text)
    assert parsed.content == text and parsed.tool_calls == []


# --- Mistral ---------------------------------------------------------------------------------

def test_mistral_list_of_calls():
    text = (f'Checking.[TOOL_CALLS] [{{"name": "weather", "arguments": {WEATHER}}}, '
            f'{{"name": "search", "arguments": {AWKWARD}}}]')
    parsed = MistralToolParser.parse(text)
    assert parsed.content == "Checking."
    assert calls_of(parsed) == [("weather", WEATHER), ("search", AWKWARD)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in parsed.tool_calls)


def test_mistral_named_calls():
    text = f'[TOOL_CALLS]weather[ARGS]{WEATHER}[TOOL_CALLS]time[CALL_ID]a1B2c3D4e[ARGS]{{}}'
    parsed = MistralToolParser.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("weather", WEATHER), ("time", "{}")]
    assert parsed.tool_calls[1].id == "a1B2c3D4e"


@pytest.mark.parametrize("text", [
    'Hi [TOOL_CALLS] [{"name": "f", "arguments": {"x": }}]',
    'Hi [TOOL_CALLS] {"name": "f"}',
    'Hi [TOOL_CALLS]f x[ARGS]{}',
    'Hi [TOOL_CALLS]f[ARGS]{"x": ',
    'Hi [TOOL_CALLS]f[ARGS]"x"',
])
def test_mistral_malformed_stays_content(text):
    parsed = MistralToolParser.parse(text)
    assert parsed.content == text and parsed.tool_calls == []


# --- streaming -------------------------------------------------------------------------------

# Outputs a stream and a whole parse agree on however they are cut: well-formed ones, and
# malformed ones judged before anything of a call is sent.
AGREEING = [
    (HermesToolParser, hermes(("weather", WEATHER))),
    (HermesToolParser, hermes(("weather", WEATHER), ("search", AWKWARD), ("time", "{}"),
                              before="Let me look.\n", after="\nDone ")),
    (HermesToolParser, "No tools needed: <tool_calling> is not a tag < >"),
    (HermesToolParser, "Try <tool_call>not json</tool_call> then " + hermes(("f", AWKWARD))),
    (HermesToolParser, '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>'),
    (Llama3JsonToolParser, (f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}; '
                           f'{{"name": "search", "parameters": {AWKWARD}}}')),
    (Llama3JsonToolParser, '{"answer": "a {b}"} is plain JSON'),
    (Llama3JsonToolParser, "  Plain text, no call."),
    (MistralToolParser, (f'Checking [TOOL_CALLS][{{"name": "weather", "arguments": {WEATHER}}}, '
                        f'{{"name": "search", "arguments": {AWKWARD}}}] done')),
    (MistralToolParser, f'[TOOL_CALLS]weather[ARGS]{WEATHER}[TOOL_CALLS]search[ARGS]{AWKWARD}'),
    (lambda: NamedCallParser("search"), AWKWARD),
    (RequiredCallsParser, (f'[{{"name": "weather", "parameters": {WEATHER}}}, '
                          f'{{"name": "search", "parameters": {AWKWARD}}}]')),
]


@pytest.mark.parametrize("make_parser,text", AGREEING)
def test_streamed_equals_whole_on_random_splits(make_parser, text):
    whole = make_parser().parse_whole(text)
    rng = random.Random(text)  # seeded: the same splits on every run
    for _ in range(25):  # 12 outputs x 25 splits
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
        content, calls, _ = stream(make_parser(), text, cuts)
        assert calls == calls_of(whole), cuts
        assert content == whole.content, cuts


@pytest.mark.parametrize("make_parser,text", AGREEING)
def test_streamed_character_by_character(make_parser, text):
    whole = make_parser().parse_whole(text)
    content, calls, _ = stream(make_parser(), text, list(range(1, len(text))))
    assert (content, calls) == (whole.content, calls_of(whole))


def test_stream_sends_arguments_as_they_arrive_and_holds_back_a_marker():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]  # " <tool" may open a call
    assert parser.feed('_call>{"name": "f", "arg') == []
    assert parser.feed('uments": ') == []  # the arguments' start decides it is a call
    header, first = parser.feed('{"x": ')
    call = header["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": ""} and call["index"] == 0
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call["id"])
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}
    assert parser.feed('"y') == [{"tool_calls": [{"index": 0, "function": {"arguments": '"y'}}]}]
    assert parser.feed('"}}</tool_call> bye') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}, {"content": "bye"}]
    assert parser.finish() == []
    assert parser.tool_calls[0].arguments == '{"x": "y"}'


# --- choosing a parser -----------------------------------------------------------------------

def test_parser_for_names_vllms_parsers():
    assert parser_for("hermes") is HermesToolParser
    assert parser_for("llama3_json") is Llama3JsonToolParser
    assert parser_for("mistral") is MistralToolParser
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parser_for("pythonic")


def test_detect_parser_from_templates():
    found = {path.name: detect_parser(path.read_text()) for path in TEMPLATES.glob("*.jinja")}
    assert found == {"tools_and_thinking.jinja": "hermes", "mistral_style.jinja": None,
                     "dated_documents.jinja": None, "gemma_style.jinja": None, "phi3_style.jinja": None}
    assert detect_parser("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("{{ '<|start_header_id|>ipython<|end_header_id|>' }}") == "llama3_json"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser(None) is None


# --- the request's tools ---------------------------------------------------------------------

def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [tool("weather", CITY), tool("time")]


def test_validate_tools_defaults():
    assert validate_tools(TOOLS).tool_choice == "auto"
    assert validate_tools().tool_choice == "none"
    assert validate_tools(TOOLS).parallel_tool_calls is True
    named = validate_tools(TOOLS, {"type": "function", "function": {"name": "time"}}, False)
    assert named.tool_choice == {"type": "function", "function": {"name": "time"}}
    assert named.forced and not named.parallel_tool_calls
    assert not validate_tools(TOOLS, "auto").forced


@pytest.mark.parametrize("arguments,param", [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [tool("a"), "b"]}, "tools[1]"),
    ({"tools": [tool("a"), {"type": "retrieval"}]}, "tools[1].type"),
    ({"tools": [tool("a"), {"type": "function"}]}, "tools[1].function"),
    ({"tools": [tool("a"), {"type": "function", "function": {}}]}, "tools[1].function.name"),
    ({"tools": [tool("a"), tool("has space")]}, "tools[1].function.name"),
    ({"tools": [tool("a"), tool("a")]}, "tools[1].function.name"),
    ({"tools": [tool("a", parameters=["x"])]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "time"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "a"}, {"description": "no name"}]}, "functions[1].name"),
    ({"tools": TOOLS, "functions": [{"name": "a"}]}, "functions"),
    ({"functions": [{"name": "a"}], "function_call": {"name": "b"}}, "function_call.function.name"),
])
def test_validate_tools_names_the_field(arguments, param):
    with pytest.raises(BadParameter) as error:
        validate_tools(**arguments)
    assert error.value.param == param
    assert param.split(".")[0].split("[")[0] in str(error.value)


def test_legacy_functions_read_as_tools():
    request = validate_tools(functions=[{"name": "weather", "parameters": CITY}],
                             function_call={"name": "weather"})
    assert request.tools == [{"type": "function", "function": {"name": "weather",
                                                               "parameters": CITY}}]
    assert request.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert validate_tools(functions=[{"name": "a"}], function_call="none").tool_choice == "none"


def test_no_schema_unless_a_call_is_forced():
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(TOOLS, "none") is None
    assert forced_parser("auto") is None and tool_calls_from_forced_output("x", "auto") == []


def test_required_schema_takes_one_to_n_calls_of_the_tools():
    schema = tool_choice_schema(TOOLS, "required", parallel_tool_calls=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "time"}], {"name": "time", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_choice_schema(TOOLS, "required", parallel_tool_calls=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    calls = tool_calls_from_forced_output(json.dumps(good), "required")
    assert [(call.name, json.loads(call.arguments)) for call in calls] == \
        [("weather", {"city": "Oslo"}), ("time", {})]


def test_required_schema_lifts_definitions_to_the_root():
    place = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "required": ["at"],
             "$defs": {"place": {"type": "string", "minLength": 2}}}
    tools = [tool("go", place), tool("time")]
    schema = tool_choice_schema(tools, "required")
    assert schema["$defs"] == {"place": {"type": "string", "minLength": 2}}
    assert "$defs" in tools[0]["function"]["parameters"]  # the request is left as it was
    jsonschema.validate([{"name": "go", "parameters": {"at": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": "O"}}], schema)
    clash = tool("back", {**place, "$defs": {"place": {"type": "integer"}}})
    with pytest.raises(BadParameter):
        tool_choice_schema([*tools, clash], "required")


def test_named_schema_is_the_functions_parameters():
    choice = {"type": "function", "function": {"name": "weather"}}
    assert tool_choice_schema(TOOLS, choice) == CITY
    jsonschema.validate({"city": "Oslo"}, tool_choice_schema(TOOLS, choice))
    no_parameters = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "time"}})
    jsonschema.validate({}, no_parameters)
    (call,) = tool_calls_from_forced_output(' {"city": "Oslo"}\n', choice)
    assert (call.name, call.arguments) == ("weather", '{"city": "Oslo"}')


def test_forced_output_cut_short_has_no_calls():
    choice = {"type": "function", "function": {"name": "weather"}}
    assert tool_calls_from_forced_output('{"city": "Os', choice) == []
    assert tool_calls_from_forced_output('[{"name": "weather", "parameters": {"ci', "required") == []
    assert forced_parser("required").parse_whole('[{"name": "time", "parameters": {}}, {"na') \
        .tool_calls[0].name == "time"
