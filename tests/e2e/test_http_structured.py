"""Structured outputs and tools through the OpenAI door of the local cluster, with the real
`openai` client: the shipped model cannot write valid JSON alone, so 200 requests with
schemas the test generates, all valid, show the grammar's mask on every token (the first
drawn by a chain's tail on the chain route); the SDK's ``parse`` with a pydantic model; a
required or named tool call whose arguments validate, streamed and not."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
from e2e_cluster import CHAIN_THRESHOLD_TOKENS, long_prompt_ids

pytestmark = pytest.mark.slow
NUM_SCHEMAS = 200



def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-4 typed properties, every one required and bounded (so an output that
    follows it ends within the request's tokens)."""
    properties = {}
    for index in range(rng.randint(1, 4)):
        kind = rng.choice(["integer", "boolean", "enum", "string", "array"]
                          + (["object"] if depth < 1 else []))
        if kind == "integer":
            schema = {"type": "integer", "minimum": -50, "maximum": 50}
        elif kind == "boolean":
            schema = {"type": "boolean"}
        elif kind == "enum":
            schema = {"enum": rng.sample(["red", "green", "blue", "cyan", "amber"], 3)}
        elif kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(1, 6), "pattern": "^[a-z]*$"}
        elif kind == "array":
            schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "maxItems": 3}
        else:
            schema = random_schema(rng, depth + 1)
        properties[f"p{index}_{kind}"] = schema
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def test_200_generated_schemas_give_valid_json_on_both_routes(api, model_id, reference):
    rng = random.Random(20261128)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    short_prompt = "def config():\n    return "
    long_prompt = long_prompt_ids(reference.tokenizer, CHAIN_THRESHOLD_TOKENS + 8)

    def ask(index: int) -> tuple[str, str, str]:
        route = "chain" if index % 4 == 0 else "local"
        prompt = long_prompt if route == "chain" else short_prompt
        answer = api.completions.create(
            model=model_id, prompt=prompt, max_tokens=160, temperature=0.7, seed=index,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": f"s{index}", "schema": schemas[index], "strict": True}},
                "prefill_route": route})
        return answer.choices[0].text, answer.choices[0].finish_reason, \
            answer.model_extra["baton"]["route"]["path"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(NUM_SCHEMAS)))
    for schema, (text, finish, _) in zip(schemas, answers):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert {path for _, _, path in answers} == {"chain", "local"}


def test_unconstrained_the_model_does_not_write_this_json(api, model_id):
    # what the mask is shown against: the same requests without it are not valid JSON
    answer = api.completions.create(model=model_id, prompt="def config():\n    return ",
                                    max_tokens=40, temperature=0.7, seed=1)
    with pytest.raises(ValueError):
        json.loads(answer.choices[0].text)


def test_regex_choice_and_json_object(api, model_id):
    prompt = "x = "
    regex = api.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=1,
                                   seed=3, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    choice = api.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=1,
                                    seed=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    # any object: its strings are the model's to end (one that runs past max_tokens is cut)
    for seed in range(5, 9):
        chat = api.chat.completions.create(model=model_id, max_tokens=300, temperature=0.3, seed=seed,
                                           messages=[{"role": "user", "content": "settings?"}],
                                           response_format={"type": "json_object"})
        if chat.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(chat.choices[0].message.content), dict)
            break
        assert chat.choices[0].message.content.startswith("{")
    else:
        pytest.fail("no json_object output ended within 300 tokens")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8, pattern="^[a-z]+$")
    celsius: int = pydantic.Field(ge=-40, le=50)
    sunny: bool


def test_the_sdk_parses_into_a_pydantic_model(api, model_id):
    completion = api.chat.completions.parse(
        model=model_id, messages=[{"role": "user", "content": "weather in oslo?"}],
        response_format=Weather, max_tokens=80, temperature=0.5, seed=7)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather) and -40 <= parsed.celsius <= 50


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8, "pattern": "^[a-z]+$"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
             "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_validates_streamed_and_not(api, model_id, tool_choice):
    request = {"model": model_id, "messages": [{"role": "user", "content": "weather?"}],
               "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 120, "temperature": 0.7,
               "seed": 11, "parallel_tool_calls": False}
    answer = api.chat.completions.create(**request).choices[0]
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = {}
    finish = None
    for chunk in api.chat.completions.create(**request, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            if delta_call.function.name:
                entry["name"] = delta_call.function.name
            entry["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert streamed == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_a_schema_the_grammar_cannot_take_is_a_400_naming_the_field(api, model_id):
    with pytest.raises(openai.BadRequestError) as error:
        api.completions.create(model=model_id, prompt="x", max_tokens=4, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"not": {"type": "string"}}}}})
    assert error.value.body["param"] == "response_format" and "not" in error.value.body["message"]
