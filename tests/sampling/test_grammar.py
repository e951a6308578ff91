"""Grammars over the shipped tokenizer, through the real library: random logits, masked,
pick the next token, and whatever the grammar lets through is what the spec asked for
(JSON that validates against its schema, a regex's match, one of the choices)."""

from __future__ import annotations

import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.tokenizer import Tokenizer
from baton.sampling.bitmask import apply_bitmask, new_bitmask
from baton.sampling.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarState,
    TokenizerInfo,
)

pytest.importorskip("llguidance")

EOS = 0  # the shipped tokenizer's <|endoftext|>
# The shipped tokenizer defines 4096 ids; a model padded past them, as many checkpoints are.
PADDED_VOCAB = 4096 + 70


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.from_model(tokenizer, PADDED_VOCAB, [EOS]))


@pytest.fixture(scope="module")
def closer_bias(tokenizer) -> torch.Tensor:
    """+2 on the tokens made only of , } ] and ": under random logits a JSON number's
    digits would otherwise run on for hundreds of tokens (nothing bounds a fraction)."""
    bias = torch.zeros(PADDED_VOCAB)
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text and set(text) <= set(',}]"'):
            bias[token_id] = 2.0
    return bias


def generate(state: GrammarState, seed: int, bias: torch.Tensor | None = None,
             max_tokens: int = 300) -> list[int]:
    """Greedy over random logits (plus ``bias``) under the mask until the grammar
    terminates."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = new_bitmask(1, PADDED_VOCAB)
    token_ids: list[int] = []
    while not state.is_terminated():
        assert len(token_ids) < max_tokens, "the grammar did not terminate"
        state.fill_mask(bitmask, 0)
        logits = torch.randn(1, PADDED_VOCAB, generator=generator)
        if bias is not None:
            logits += bias
        apply_bitmask(logits, bitmask)
        assert torch.isinf(logits[0, 4096:]).all(), "a padded id was allowed"
        token_id = int(logits.argmax())
        assert state.accept(token_id), state.error
        token_ids.append(token_id)
    return token_ids


def text_of(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode([t for t in token_ids if t != EOS])


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: typed, bounded properties (so random tokens end), enums, arrays,
    nested objects, alternatives, a random ``required`` list; at the top, sometimes a
    definition referred to."""
    properties = {f"{rng.choice('abcdefgh')}{i}": random_property(rng, depth)
                  for i in range(rng.randint(1, 5 if depth == 0 else 3))}
    required = [name for name in properties if rng.random() < 0.6]
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    if depth == 0 and rng.random() < 0.3:
        schema["$defs"] = {"item": random_schema(rng, depth=2)}
        properties["ref"] = {"$ref": "#/$defs/item"}
    return schema


def random_property(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean", "null", "array"]
    if depth < 2:
        kinds += ["object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(
            [r"^[A-Z][a-z]{1,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^(yes|no|maybe)$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None, "a b", "x\"y"], 3)}
    if kind == "array":
        return {"type": "array", "items": random_property(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "object":
        return random_schema(rng, depth + 1)
    if kind == "anyOf":
        return {"anyOf": [random_property(rng, depth + 1), random_property(rng, depth + 1)]}
    return {"type": kind}


@pytest.mark.parametrize("schema_seed", range(50))
def test_random_schemas_give_valid_json(compiler, tokenizer, closer_bias, schema_seed):
    spec = GrammarSpec("json_schema", json.dumps(random_schema(random.Random(schema_seed))))
    grammar = compiler.compile(spec)
    for logits_seed in range(4):
        token_ids = generate(grammar.new_state(), 1000 * schema_seed + logits_seed,
                             closer_bias)
        text = text_of(tokenizer, token_ids)
        # strict: the schema as compiled forbids properties it does not list
        jsonschema.validate(json.loads(text), spec.schema())


def test_json_object_gives_an_object(compiler, tokenizer, closer_bias):
    grammar = compiler.compile(GrammarSpec("json_object"))
    for seed in range(5):
        token_ids = generate(grammar.new_state(), seed, closer_bias)
        assert isinstance(json.loads(text_of(tokenizer, token_ids)), dict)
    state = grammar.new_state()
    assert state.replay(tokenizer.encode('{"a":[1,{"b":null}],"c":"d"}'))
    assert state.is_terminated()
    assert not grammar.new_state().replay(tokenizer.encode("[1]"))


def test_strict_off_lets_other_properties_through(compiler, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    extra = tokenizer.encode('{"a":1,"zzz":2}')
    assert not compiler.compile(GrammarSpec("json_schema", schema)).new_state().replay(extra)
    loose = compiler.compile(GrammarSpec("json_schema", schema, strict=False))
    assert loose.new_state().replay(extra)


def test_whitespace_only_when_asked(compiler, tokenizer):
    spaced = tokenizer.encode('{ "a": 1 }')
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert not compiler.compile(GrammarSpec("json_schema", schema)).new_state().replay(spaced)
    flexible = compiler.compile(GrammarSpec("json_schema", schema, any_whitespace=True))
    assert flexible.new_state().replay(spaced)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,5}", r"(cat|dog)s?", r"[A-F0-9]{8}",
                                     r"\d+\.\d{2} (USD|EUR)"])
def test_regex(compiler, tokenizer, pattern):
    grammar = compiler.compile(GrammarSpec("regex", pattern))
    for seed in range(5):
        assert re.fullmatch(pattern, text_of(tokenizer, generate(grammar.new_state(), seed)))


def test_choice(compiler, tokenizer):
    choices = ["positive", "negative", 'say "hi"', "café", "neg"]
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(choices)))
    seen = {text_of(tokenizer, generate(grammar.new_state(), seed)) for seed in range(20)}
    assert seen <= set(choices) and len(seen) > 1


@pytest.mark.parametrize("grammar_text", [
    'root ::= "(" num op num ")"\nnum ::= [0-9] [0-9]?\nop ::= "+" | "*"',  # GBNF
    'start: "(" NUM OP NUM ")"\nNUM: /[0-9][0-9]?/\nOP: "+" | "*"',  # Lark
])
def test_ebnf_and_lark_grammars(compiler, tokenizer, grammar_text):
    grammar = compiler.compile(GrammarSpec("grammar", grammar_text))
    for seed in range(5):
        text = text_of(tokenizer, generate(grammar.new_state(), seed))
        assert re.fullmatch(r"\([0-9]{1,2}[+*][0-9]{1,2}\)", text), text


def test_terminated_state_allows_only_eos(compiler):
    state = compiler.compile(GrammarSpec("choice", '["yes"]')).new_state()
    generate(state, seed=0)
    bitmask = new_bitmask(1, PADDED_VOCAB)
    state.fill_mask(bitmask, 0)
    logits = torch.zeros(1, PADDED_VOCAB)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_replay_rebuilds_the_same_state(compiler, closer_bias):
    spec = GrammarSpec("json_schema", json.dumps(random_schema(random.Random(7))))
    grammar = compiler.compile(spec)
    token_ids = generate(grammar.new_state(), 3, closer_bias)
    for cut in (0, 1, len(token_ids) // 2, len(token_ids) - 1):
        stepped = grammar.new_state()
        for token_id in token_ids[:cut]:
            assert stepped.accept(token_id)
        replayed = grammar.new_state()
        assert replayed.accept(token_ids[0])  # a state elsewhere: replay starts over
        assert replayed.replay(token_ids[:cut])
        masks = new_bitmask(2, PADDED_VOCAB)
        stepped.fill_mask(masks, 0)
        replayed.fill_mask(masks, 1)
        assert torch.equal(masks[0], masks[1]), cut
    done = grammar.new_state()
    assert done.replay(token_ids) and done.is_terminated()


def test_a_token_the_grammar_refuses(compiler, tokenizer):
    grammar = compiler.compile(GrammarSpec("regex", "[0-9]+"))
    state = grammar.new_state()
    assert not state.accept(tokenizer.encode("x")[0])
    assert "x" in state.error
    assert not grammar.new_state().accept(4100)  # a padded id
    assert not grammar.new_state().replay(tokenizer.encode("12x"))
    assert grammar.new_state().error == ""


def test_cache_returns_the_compiled_grammar(tokenizer):
    compiler = GrammarCompiler(TokenizerInfo.from_model(tokenizer, PADDED_VOCAB, [EOS]),
                               max_cached_grammars=2)
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "null"}}}
    first = compiler.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert isinstance(first, CompiledGrammar)
    # the same schema spelt with other whitespace: the same entry
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(schema, indent=2))) is first
    # what changes the grammar changes the key
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(schema), strict=False)) \
        is not first
    reordered = json.dumps({"type": "object", "properties": dict(reversed(
        schema["properties"].items()))})
    assert GrammarSpec("json_schema", reordered).key() != first.spec.key()
    # bounded: two newer grammars push the least recently used one out
    compiler.compile(GrammarSpec("regex", "a"))
    compiler.compile(GrammarSpec("regex", "b"))
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(schema))) is not first


def test_concurrent_compiles_share_one_grammar(tokenizer):
    compiler = GrammarCompiler(TokenizerInfo.from_model(tokenizer, PADDED_VOCAB, [EOS]))
    spec = GrammarSpec("json_schema", json.dumps(random_schema(random.Random(11))))
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(lambda _: compiler.compile(spec), range(16)))
    assert all(grammar is compiled[0] for grammar in compiled)


@pytest.mark.parametrize(("kind", "text", "message"), [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
    ("choice", "[]", "non-empty JSON list of strings"),
    ("regex", " ", "the regex is empty"),
    ("xml", "<a/>", "unknown grammar kind"),
])
def test_invalid_specs(kind, text, message):
    with pytest.raises(GrammarError, match=message):
        GrammarSpec(kind, text)


@pytest.mark.parametrize(("kind", "text", "message"), [
    ("json_schema", '{"type": "objec"}', "objec"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", '{"not": {"type": "string"}}', "not"),  # a keyword it does not implement
    ("regex", "[0-9", "regex"),
    ("grammar", "root ::= (", "GBNF"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
])
def test_what_the_library_rejects(compiler, kind, text, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(GrammarSpec(kind, text))


def test_strict_closes_objects_but_not_combined_parts():
    spec = GrammarSpec("json_schema", json.dumps({
        "type": "object",
        "properties": {
            # a property named "properties" is a property, not a keyword
            "properties": {"type": ["object", "null"]},
            "parts": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                {"properties": {"b": {"type": "object"}}}]},
            "ref": {"$ref": "#/$defs/item", "properties": {"c": {"type": "null"}}},
        },
        "$defs": {"item": {"type": "object", "properties": {"d": {"type": "null"}}}},
    }))
    schema = spec.schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["properties"]["additionalProperties"] is False
    parts = schema["properties"]["parts"]
    assert "additionalProperties" not in parts and "additionalProperties" not in parts["allOf"][0]
    assert parts["allOf"][1]["properties"]["b"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["ref"]
    assert schema["$defs"]["item"]["additionalProperties"] is False
    assert "additionalProperties" not in GrammarSpec("json_schema", spec.text,
                                                     strict=False).schema()


def test_mask_row_of_the_wrong_width(compiler):
    state = compiler.compile(GrammarSpec("regex", "a")).new_state()
    with pytest.raises(ValueError, match="int32"):
        state.fill_mask(new_bitmask(1, 4096), 0)


def test_a_model_narrower_than_its_tokenizer(tokenizer):
    """The mask covers every id the tokenizer defines; apply_bitmask cuts it to the logits."""
    compiler = GrammarCompiler(TokenizerInfo.from_model(tokenizer, 4000, [EOS]))
    assert compiler.vocab_size == 4096
    state = compiler.compile(GrammarSpec("choice", '["yes", "no"]')).new_state()
    bitmask = new_bitmask(1, compiler.vocab_size)
    state.fill_mask(bitmask, 0)
    logits = torch.zeros(1, 4000)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).any()


def test_a_model_without_eos(tokenizer):
    with pytest.raises(GrammarError, match="EOS"):
        GrammarCompiler(TokenizerInfo.from_model(tokenizer, PADDED_VOCAB, []))


def test_without_the_package(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import raises ImportError
    with pytest.raises(GrammarError, match=r"'llguidance' package: pip install baton\[structured\]"):
        GrammarCompiler(TokenizerInfo.from_model(tokenizer, PADDED_VOCAB, [EOS]))
