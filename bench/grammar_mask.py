"""Structured outputs: which grammar library, xgrammar or llguidance, costs less per token?

One question: over a checkpoint's tokenizer, what does each library spend to constrain one
decode step of a JSON-schema request, and to compile the schema?

* **mask**: the allowed-token bitmask of the next token (the library's fill), then setting
  the disallowed logits to -inf (baton's ``apply_bitmask``, torch ops, one call for all
  rows; xgrammar's own CPU kernel beside it in a table of its own), then accepting the
  argmax of the masked logits; the fill and the apply are timed, per step. Random logits
  (a seeded generator) drive the generation; a matcher that terminates starts over.
  Rows: 1, 8 and 32 requests, each its own matcher; the batch's fill is the library's
  parallel call (xgrammar's ``BatchGrammarMatcher``, llguidance's ``LLExecutor``).
* **compile**: the tokenizer's preparation once, then the schema's compilation, cold.
* **formats**: whether each compiles json_object, a regex, a choice, a GBNF grammar and a
  Lark grammar, as vLLM's guided_* fields hand them over.

JSON is compact (no free whitespace) and objects take only the properties they list, as
baton asks of both libraries.

Needs both libraries: ``pip install xgrammar==0.2.8 llguidance==1.9.1`` (baton itself
installs only llguidance, with the ``structured`` extra). Figures: docs/runtime-log.md,
"Structured outputs".

usage: python bench/grammar_mask.py [--tokenizer models/baton-pystdlib | --bpe-vocab 32000]
       [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from baton.sampling.bitmask import apply_bitmask

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, describe_machine, machine

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "score": {"type": "number"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "status", "tags", "address"],
    "additionalProperties": False,
}
FORMATS = {
    "json_object": ("json", '{"type": "object"}'),
    "regex": ("regex", r"[0-9]{3}-[0-9]{4}( ext\. [0-9]+)?"),
    "choice": ("choice", '["positive", "negative", "neutral"]'),
    "gbnf": ("gbnf", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ (("+" | "*") [0-9]+)*'),
    "lark": ("lark", 'start: "(" expr ")"\nexpr: NUMBER (("+" | "*") NUMBER)*\nNUMBER: /[0-9]+/'),
}


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab: list[str], vocab_size: int,
                 eos_ids: list[int]) -> None:
        import xgrammar
        self.xgr = xgrammar
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        info = xgrammar.TokenizerInfo(vocab, metadata["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=eos_ids,
                                      add_prefix_space=metadata["add_prefix_space"])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile_schema(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def compile_format(self, kind: str, text: str):
        if kind == "json":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":
            return self.compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
        if kind == "gbnf":
            return self.compiler.compile_grammar(text)
        return self.compiler.compile_lark(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: list[str], vocab_size: int,
                 eos_ids: list[int]) -> None:
        import llguidance
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_ids)
        self.executor = llguidance.LLExecutor()

    def compile_schema(self, schema: str):
        return self._compile(self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))

    def compile_format(self, kind: str, text: str):
        return self._compile(self.llg.grammar_from(kind, text))

    def _compile(self, grammar: str):
        """A matcher in its start state: building it is the compilation; requests copy it."""
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llg.torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg.torch.fill_next_token_bitmask_par(
                self.executor, [(m, row) for row, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def apply_with_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Either library's bitmask (LSB first, 32 ids a word) applied as baton does."""
    apply_bitmask(logits, bitmask)


def apply_with_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same through xgrammar's kernel (C++ on CPU, Triton on CUDA)."""
    import xgrammar
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)


def measure_mask(library, compiled, rows: int, steps: int, vocab_size: int) -> dict:
    """Per step: fill's and apply's µs (median, p99), over ``steps`` steps of ``rows`` rows."""
    generator = torch.Generator().manual_seed(0)
    matchers = [library.matcher(compiled) for _ in range(rows)]
    bitmask = torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_us, apply_us = [], []
    for _ in range(steps):
        logits = torch.randn(rows, vocab_size, generator=generator)
        start = time.perf_counter()
        library.fill(matchers, bitmask)
        filled = time.perf_counter()
        apply_with_torch(logits, bitmask)
        applied = time.perf_counter()
        fill_us.append((filled - start) * 1e6)
        apply_us.append((applied - filled) * 1e6)
        for row, token_id in enumerate(logits.argmax(dim=1).tolist()):
            assert library.accept(matchers[row], token_id), (library.name, row, token_id)
            if library.done(matchers[row]):
                matchers[row] = library.matcher(compiled)
    return {"fill_us": percentiles(fill_us), "apply_us": percentiles(apply_us)}


def measure_apply(apply, rows: int, vocab_size: int, steps: int) -> float:
    """Median µs of ``apply`` over random logits and a random bitmask of ``rows`` rows."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab_size + 31) // 32),
                            dtype=torch.int32, generator=generator)
    logits = torch.randn(rows, vocab_size, generator=generator)
    timings = []
    for _ in range(steps):
        copy = logits.clone()
        start = time.perf_counter()
        apply(copy, bitmask)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings) * 1e6


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def measure_compile(library_class, tokenizer_args: tuple, schema: str) -> dict:
    start = time.perf_counter()
    library = library_class(*tokenizer_args)
    prepared = time.perf_counter()
    library.compile_schema(schema)
    compiled = time.perf_counter()
    return {"tokenizer_ms": (prepared - start) * 1e3, "schema_ms": (compiled - prepared) * 1e3}


def formats_supported(library) -> dict[str, str]:
    supported = {}
    for name, (kind, text) in FORMATS.items():
        try:
            library.compile_format(kind, text)
            supported[name] = "yes"
        except Exception as error:  # noqa: BLE001 - each library raises its own types
            supported[name] = f"no ({str(error).splitlines()[0][:60]})"
    return supported


def load_tokenizer(directory: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def trained_bpe(vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) learnt from the standard library's sources."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = (path.read_bytes().decode("utf-8", errors="replace") for path in sources[:2000])
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "baton-pystdlib",
                        help="a checkpoint's directory holding tokenizer.json")
    parser.add_argument("--bpe-vocab", type=int, default=0,
                        help="instead, a byte-level BPE of this many tokens trained here on "
                             "this Python's standard library (a vocabulary of a real model's "
                             "size; ~15 s for 32000)")
    parser.add_argument("--steps", type=int, default=400, help="decode steps per figure")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads (1: a busy shared host stalls parallel ops)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = trained_bpe(args.bpe_vocab) if args.bpe_vocab else load_tokenizer(args.tokenizer)
    vocab = [""] * tokenizer.get_vocab_size()
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        vocab[token_id] = token
    eos_id = tokenizer.token_to_id("<|endoftext|>") or 0
    # A model's vocabulary padded past the tokenizer's, as many checkpoints have it.
    vocab_size = (len(vocab) + 63) // 64 * 64 + 64
    tokenizer_args = (tokenizer.to_str(), vocab, vocab_size, [eos_id])
    schema = json.dumps(SCHEMA)

    record = machine()
    print(f"host: {describe_machine(record)}")
    source = "BPE trained here" if args.bpe_vocab else args.tokenizer
    print(f"tokenizer: {source} ({len(vocab)} tokens, model vocabulary {vocab_size})")
    print(f"torch threads: {torch.get_num_threads()}; {args.steps} steps per row count\n")
    print("| library | rows | fill µs (p50 / p99) | apply µs (p50 / p99) | per row µs (p50) |")
    print("|---|---|---|---|---|")
    libraries = [Xgrammar(*tokenizer_args), Llguidance(*tokenizer_args)]
    for library in libraries:
        compiled = library.compile_schema(schema)
        for rows in (1, 8, 32):
            figures = measure_mask(library, compiled, rows, args.steps, vocab_size)
            fill, apply = figures["fill_us"], figures["apply_us"]
            print(f"| {library.name} | {rows} | {fill[0]:.0f} / {fill[1]:.0f} | "
                  f"{apply[0]:.0f} / {apply[1]:.0f} | {(fill[0] + apply[0]) / rows:.0f} |")
    print("\nApplying a random bitmask (µs, p50):\n")
    print("| rows | torch ops | xgrammar's kernel |")
    print("|---|---|---|")
    for rows in (1, 8, 32):
        print(f"| {rows} | {measure_apply(apply_with_torch, rows, vocab_size, args.steps):.0f} | "
              f"{measure_apply(apply_with_xgrammar, rows, vocab_size, args.steps):.0f} |")
    print("\n| library | tokenizer prepared (ms) | schema compiled, cold (ms) |")
    print("|---|---|---|")
    for library_class in (Xgrammar, Llguidance):
        figures = measure_compile(library_class, tokenizer_args, schema)
        print(f"| {library_class.name} | {figures['tokenizer_ms']:.1f} | "
              f"{figures['schema_ms']:.1f} |")
    print("\n| library | " + " | ".join(FORMATS) + " |")
    print("|---|" + "---|" * len(FORMATS))
    for library in libraries:
        supported = formats_supported(library)
        print(f"| {library.name} | " + " | ".join(supported[name] for name in FORMATS) + " |")


if __name__ == "__main__":
    main()
