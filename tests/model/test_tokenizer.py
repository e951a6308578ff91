"""Streaming text: the deltas of ``IncrementalDecoder`` add up to the whole output's text,
whatever the tokens (characters split over several byte-level tokens included), while each
push decodes a window of a few tokens, not the whole output."""

from __future__ import annotations

import random

import pytest
from baton.model.hub import SHIPPED_MODEL_DIR
from baton.model.tokenizer import IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED_MODEL_DIR)


def stream(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[list[str], str]:
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(token) for token in token_ids]
    deltas.append(decoder.flush())
    assert decoder.text == "".join(deltas)
    return deltas, decoder.text


@pytest.mark.parametrize("text", [
    "def add(a, b):\n    return a + b\n",
    "  leading spaces, then words",
    "naïve café — “quoted” ✓ 数据 🚀🚀 end",  # characters of 2-4 UTF-8 bytes
])
def test_the_deltas_add_up_to_the_text(tokenizer, text):
    token_ids = tokenizer.encode(text)
    deltas, streamed = stream(tokenizer, token_ids)
    assert streamed == tokenizer.decode(token_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)  # a split character waits


def test_random_tokens_stream_the_same_text_as_one_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 80))]
        assert stream(tokenizer, token_ids)[1] == tokenizer.decode(token_ids)


def test_each_push_decodes_a_window_not_the_whole_output(tokenizer):
    calls: list[int] = []
    decode = tokenizer.decode

    class Counting(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=True):
            calls.append(len(token_ids))
            return decode(token_ids, skip_special_tokens)

    counting = Counting(tokenizer._tokenizer)
    token_ids = tokenizer.encode("word " * 400)
    assert stream(counting, token_ids)[1] == tokenizer.decode(token_ids)
    assert max(calls) <= 8  # the unreleased tokens and the last release's, never all 400
