"""Grammars that constrain generation (structured outputs), through llguidance.

Design: a ``GrammarSpec`` says what the output must be (a JSON schema, any JSON object, a
regex, one of fixed choices, a Lark or GBNF grammar), read off the request by the door
and checked there. One ``GrammarCompiler`` per model turns a spec into a
``CompiledGrammar`` over the model's tokenizer, cached by the spec's key; each request
takes a ``GrammarState`` from it, which writes the ids allowed next into its row of the
batch's bitmask (``baton.sampling.bitmask``) and advances on the sampled token.

llguidance rather than xgrammar (docs/runtime-log.md, "Structured outputs"): it walks the
tokenizer's trie lazily, step by step, where xgrammar builds a schema's whole token-mask
cache before the first token, a cost that grows with the vocabulary and lands in the time
to first token of every request that brings a new schema; and it installs without
dependencies. It is imported only when a compiler is built, so baton runs without it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from baton.model.tokenizer import Tokenizer
from baton.sampling.bitmask import num_words

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
PACKAGE = "llguidance"
# Distinct specs a model keeps compiled: clients that send a schema tend to send the same
# few again, and the bound keeps one-off schemas from piling up.
DEFAULT_MAX_CACHED_GRAMMARS = 256
# Schema keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "not", "if", "then",
                  "else", "contains", "propertyNames", "unevaluatedItems",
                  "unevaluatedProperties")
_LIST_OF_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems", "items")
_MAP_OF_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions",
                      "dependentSchemas")


class GrammarError(ValueError):
    """A grammar that cannot constrain generation: invalid, unsupported, or no library."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be.

    ``text``: the JSON schema (json_schema), the regex, a JSON list of the choices
    (choice), the Lark or GBNF grammar (grammar); unused by json_object (any JSON object).
    ``strict``: an object schema that does not say otherwise takes only the properties it
    lists (``additionalProperties: false``), as OpenAI's strict mode and vLLM's xgrammar
    have it; False reads the schema as JSON Schema does (any other property allowed).
    ``any_whitespace``: JSON may carry free whitespace between its tokens; off, a model
    that favours whitespace cannot spend its tokens on it.
    """

    kind: str
    text: str = ""
    strict: bool = True
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")
        if self.kind == "json_schema":
            self.schema()
        elif self.kind == "choice":
            self.choices()
        elif self.kind in ("regex", "grammar") and not self.text.strip():
            raise GrammarError(f"the {self.kind} is empty")

    def schema(self) -> dict[str, Any]:
        """The JSON schema, as the library is given it (``strict`` applied)."""
        schema = _parse_json(self.text, "the JSON schema")
        if not isinstance(schema, dict):
            raise GrammarError(f"the JSON schema must be a JSON object, not {self.text!r}")
        if self.strict:
            _forbid_unlisted_properties(schema)
        return schema

    def choices(self) -> list[str]:
        choices = _parse_json(self.text, "the choices")
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(choice, str) for choice in choices)):
            raise GrammarError(f"the choices must be a non-empty JSON list of strings, "
                               f"not {self.text!r}")
        return choices

    def key(self) -> tuple[str, str, bool, bool]:
        """Everything that changes the compiled grammar; JSON texts in one spelling, so a
        schema sent with other whitespace hits the same entry (property order is kept:
        the output follows it)."""
        text = self.text
        if self.kind in ("json_schema", "choice"):
            text = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        elif self.kind == "json_object":
            text = ""
        return (self.kind, text, self.strict, self.any_whitespace)


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from e


def _forbid_unlisted_properties(schema: Any, in_all_of: bool = False) -> None:
    """Sets ``additionalProperties: false`` on every object schema that leaves it open, in
    place. A schema combined with others (an ``allOf`` member, or one holding ``allOf`` or
    a ``$ref`` beside its properties) is left open: each part lists only some of the
    properties the whole allows."""
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    is_object = ("properties" in schema or types == "object"
                 or (isinstance(types, list) and "object" in types))
    combined = in_all_of or "allOf" in schema or "$ref" in schema
    if (is_object and not combined and "additionalProperties" not in schema
            and "unevaluatedProperties" not in schema):
        schema["additionalProperties"] = False
    for keyword in _ONE_SUBSCHEMA:
        _forbid_unlisted_properties(schema.get(keyword))
    for keyword in _LIST_OF_SUBSCHEMAS:
        if isinstance(schema.get(keyword), list):
            for member in schema[keyword]:
                _forbid_unlisted_properties(member)
    for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        _forbid_unlisted_properties(member, in_all_of=True)
    for keyword in _MAP_OF_SUBSCHEMAS:
        if isinstance(schema.get(keyword), dict):
            for member in schema[keyword].values():
                _forbid_unlisted_properties(member)


def _library_message(error: str) -> str:
    """llguidance's error without the parser's state dump that follows it."""
    return error.split("\n<state>", 1)[0].strip()


def _import_library():
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(f"structured outputs need the '{PACKAGE}' package: "
                           f"pip install baton[structured]") from e
    return llguidance


@dataclass(frozen=True)
class TokenizerInfo:
    """What a grammar needs of a model: its tokenizer (as tokenizer.json holds it, and the
    number of ids it defines, added tokens included), the width of its logits (wider than
    the tokenizer's ids when padded: those ids are never allowed) and the ids that end a
    sequence."""

    tokenizer_json: str
    num_tokenizer_ids: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_model(cls, tokenizer: Tokenizer, vocab_size: int,
                   eos_token_ids: list[int]) -> TokenizerInfo:
        """From baton's tokenizer and ``ModelConfig.vocab_size`` / ``.eos_token_ids``."""
        return cls(tokenizer.to_json(), tokenizer.vocab_size, vocab_size,
                   tuple(eos_token_ids))


class CompiledGrammar:
    """A grammar over one model's tokenizer, in its start state; shared by the requests
    that ask for it (read only), each taking its own ``GrammarState``."""

    def __init__(self, spec: GrammarSpec, start: Any, mask_words: int) -> None:
        self.spec = spec
        self.mask_words = mask_words  # int32 words in a bitmask row its states fill
        self._start = start  # an llguidance LLMatcher that never advances

    def new_state(self) -> GrammarState:
        return GrammarState(self)

    def _fresh_matcher(self) -> Any:
        return self._start.deep_copy()  # cheap: the copy shares the compiled grammar


class GrammarState:
    """One request's place in its grammar."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher = grammar._fresh_matcher()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the ids allowed next into ``bitmask[row]`` (a ``new_bitmask`` of the
        compiler's ``vocab_size``); once terminated, only the EOS ids."""
        words = self.grammar.mask_words
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
                or bitmask.dim() != 2 or bitmask.shape[1] != words
                or not bitmask.is_contiguous()):
            raise ValueError(f"bitmask must be a contiguous CPU int32 [batch, {words}] "
                             f"tensor, not {bitmask.dtype} {list(bitmask.shape)} on "
                             f"{bitmask.device}")
        target = bitmask[row]
        # the library writes the row through its address, without the GIL
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), words * 4)

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False if the grammar does not allow it (the state is
        then broken for good: ``error`` says why)."""
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """The output is complete: nothing but EOS may follow, or EOS was accepted."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the last ``accept`` failed ("" if none did)."""
        return _library_message(self._matcher.get_error()) if self._matcher.is_error() else ""

    def replay(self, token_ids: list[int]) -> bool:
        """Rebuilds the state from the start through ``token_ids`` (a request that moved
        pods brings its tokens, not its state); False if they do not follow the grammar."""
        self._matcher = self.grammar._fresh_matcher()
        return self._matcher.consume_tokens(token_ids) if token_ids else True


class GrammarCompiler:
    """Compiles specs over one model's tokenizer; built once per model.

    ``compile`` may run on several threads at once: the library compiles without the GIL;
    the cache is guarded by a lock, held only to look up and insert. Two threads compiling
    one new spec both compile, and both get the first one cached.
    """

    def __init__(self, info: TokenizerInfo,
                 max_cached_grammars: int = DEFAULT_MAX_CACHED_GRAMMARS) -> None:
        if not info.eos_token_ids:
            raise GrammarError("structured outputs need the model's EOS token ids "
                               "(eos_token_id in config.json or generation_config.json)")
        if max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars {max_cached_grammars} must be >= 1")
        self._library = _import_library()
        self._tokenizer = self._library_tokenizer(info)
        # the width of the bitmask rows its states fill: new_bitmask(batch, vocab_size)
        self.vocab_size = self._tokenizer.vocab_size
        self._max_cached = max_cached_grammars
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _library_tokenizer(self, info: TokenizerInfo) -> Any:
        # The tokenizer's own count when the model's logits are narrower: the library's
        # mask covers every id the tokenizer defines (apply_bitmask cuts it to the logits).
        try:
            return self._library.LLTokenizer(
                info.tokenizer_json, n_vocab=max(info.vocab_size, info.num_tokenizer_ids),
                eos_token=list(info.eos_token_ids))
        except ValueError as e:
            raise GrammarError(f"{PACKAGE} cannot read the tokenizer: {e}") from e

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec's grammar, from the cache when compiled before; GrammarError if the
        library rejects it (the message names what it could not take)."""
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        compiled = CompiledGrammar(spec, self._start_matcher(spec), num_words(self.vocab_size))
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _start_matcher(self, spec: GrammarSpec) -> Any:
        library = self._library
        try:
            grammar = self._library_grammar(spec)
        except ValueError as e:  # the library's converters raise ValueError
            raise GrammarError(f"invalid {spec.kind}: {e}") from e
        # building the matcher compiles the grammar (without the GIL); errors land in it
        matcher = library.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {_library_message(matcher.get_error())}")
        return matcher

    def _library_grammar(self, spec: GrammarSpec) -> str:
        library = self._library
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.schema() if spec.kind == "json_schema" else {"type": "object"}
            # overrides: the spec decides, whatever "x-guidance" options the schema carries
            return library.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": spec.any_whitespace})
        if spec.kind == "choice":
            return library.grammar_from("choice", json.dumps(spec.choices()))
        return library.grammar_from(spec.kind, spec.text)  # "regex" or "grammar"

