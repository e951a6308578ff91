"""The model shipped in models/baton-pystdlib: small, long enough, GQA, trained, writes Python."""

from __future__ import annotations

import io
import json
import math
import tokenize

import pytest
import torch
from baton.config import KVPoolConfig, SchedulerConfig
from baton.model import load_checkpoint
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.sampling.params import SamplingParams
from baton.sarathi import Engine
from baton.train.corpus import END_OF_TEXT, held_out_text
from baton.train.forward import next_token_loss
from baton.train.sample import greedy_continuation
from baton.train.trainer import held_out_windows
from safetensors import safe_open

MAX_BYTES = 16 * 1024 * 1024
PROMPTS = [
    "import os\n\n\ndef read_file(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def is_prime(n):\n    if n < 2:\n",
]
# Greedy decoding of a model this small loops on the most frequent pattern it memorised:
# after ``class Stack: def __init__(self):`` it writes tkinter's ``self.tk.call(self._w,
# self._w, ...`` without ever ending the line. Strict: it reports XPASS once a better model
# fixes it, and the marker must go then.
LOOPS_ON_ONE_LINE = pytest.mark.xfail(strict=True, reason="greedy continuation repeats "
                                      "`self._w,` on one line (tkinter's self.tk.call pattern)")
PROMPT_CASES = [PROMPTS[0], pytest.param(PROMPTS[1], marks=LOOPS_ON_ONE_LINE), PROMPTS[2]]
KEYWORDS = {"def", "return", "if", "else", "for", "in", "self", "not", "None", "import",
            "raise", "is", "elif", "while", "try", "except", "class", "and", "or", "with"}


@pytest.fixture(scope="module")
def shipped():
    torch.set_num_threads(2)
    return load_checkpoint(SHIPPED_MODEL_DIR, dtype="float32", device="cpu")


def test_shipped_files_fit_the_size_budget_and_are_fp16():
    files = {path.name: path.stat().st_size for path in SHIPPED_MODEL_DIR.iterdir() if path.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) <= MAX_BYTES, files
    with safe_open(str(SHIPPED_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F16"}  # noqa: SIM118 (safe_open is not iterable)


def test_shipped_config_has_long_context_gqa_and_end_of_text_eos(shipped):
    config = shipped.config
    assert config.max_position_embeddings >= 1024
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.eos_token_id == shipped.tokenizer.token_id(END_OF_TEXT)
    assert config.vocab_size == shipped.tokenizer.vocab_size


def test_greedy_generation_equals_transformers_generate(shipped):
    # The served path (SARATHI engine, paged KV, chunked prefill of the three prompts
    # batched together) against Hugging Face's generate() on the same fp16 weights in fp32.
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL_DIR, dtype=torch.float32).eval()
    engine = Engine(shipped.model, shipped.tokenizer,
                    scheduler=SchedulerConfig(token_budget=64, max_running=4),
                    kv=KVPoolConfig(block_size=16, num_blocks=256))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = torch.tensor([shipped.tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                          pad_token_id=shipped.config.eos_token_id)
        assert result.token_ids == expected[0, ids.shape[1]:].tolist(), prompt


def test_shipped_model_predicts_held_out_code_far_better_than_chance(shipped):
    # Four full-context windows of held-out text (files the model never trained on).
    ids = torch.tensor(shipped.tokenizer.encode(held_out_text()))
    windows = held_out_windows(ids, 1024, limit=4)  # [4, 1025]
    with torch.no_grad():
        loss = next_token_loss(shipped.model, windows).item()
    chance = math.log(shipped.config.vocab_size)  # 8.3 nats for 4096 tokens
    assert loss < 0.4 * chance, loss
    reported = json.loads((SHIPPED_MODEL_DIR / "training.json").read_text())["result"]
    assert reported["held_out_loss"] < 0.4 * chance


def python_tokens(source: str) -> list[tokenize.TokenInfo]:
    """Python's own lexer over ``source``, up to where the text stops.

    A continuation cut after a fixed number of tokens may end inside a docstring or an
    open bracket; the lexer then raises at end of input, which says nothing about what
    was written before the cut. Anything malformed before it (a stray character, a bad
    dedent) still shows as an ERRORTOKEN or raises IndentationError.
    """
    tokens: list[tokenize.TokenInfo] = []
    try:
        tokens.extend(tokenize.generate_tokens(io.StringIO(source).readline))
    except tokenize.TokenError as e:
        assert "EOF" in e.args[0], e
    return tokens


def indentation(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


@pytest.mark.parametrize("prompt", PROMPT_CASES)
def test_greedy_continuation_is_python(shipped, prompt):
    continuation = greedy_continuation(shipped.model, shipped.tokenizer, prompt, 64)
    complete_lines = continuation[:continuation.rfind("\n") + 1]
    assert complete_lines.count("\n") >= 2, continuation
    # Every line written lexes as Python, with no stray characters...
    tokens = python_tokens(prompt + complete_lines)
    assert not [t for t in tokens if t.type == tokenize.ERRORTOKEN and t.string.strip()], continuation
    # ...the first line continues the block the prompt opened (indented under its last line)...
    last_prompt_line = prompt.rstrip("\n").splitlines()[-1]
    assert indentation(continuation.splitlines()[0]) > indentation(last_prompt_line), continuation
    # ...and is code, not prose: Python keywords and names joined by operators.
    prompt_lines = prompt.count("\n")
    own_tokens = [t for t in tokens if t.start[0] > prompt_lines]
    words = {t.string for t in own_tokens if t.type == tokenize.NAME}
    assert len(words & KEYWORDS) >= 2, continuation
    assert any(t.type == tokenize.OP for t in own_tokens), continuation
