"""The shipped model's tokenizer: byte-level round trips, newlines kept apart from indentation."""

from __future__ import annotations

from baton.train.bpe import encode_documents, train_tokenizer
from baton.train.corpus import END_OF_TEXT

CODE = ("def area(width, height):\n    if width < 0:\n        raise ValueError(width)\n"
        "    return width * height\n\n\nclass Box:\n    pass\n")


def _tokenizer():
    return train_tokenizer([CODE * 3, "x = 'naïve ☃'\n" * 5], vocab_size=400)


def test_any_text_round_trips_byte_for_byte():
    tokenizer = _tokenizer()
    for text in (CODE, "x = 'naïve ☃'\r\n\ttab", "\x00\x7f binary-ish \U0001f600"):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_a_newline_is_a_token_of_its_own_so_a_prompt_may_end_at_a_line_break():
    tokenizer = _tokenizer()
    tokens = tokenizer.encode(CODE).tokens
    newline = "\u010a"  # byte-level's printable stand-in for "\n"
    assert tokens.count(newline) == CODE.count("\n")
    assert all(newline not in token or token == newline for token in tokens)
    # The prompt "def area(width, height):\n" ends in the same token as in the training text.
    prompt = tokenizer.encode("def area(width, height):\n").ids
    assert tokenizer.encode(CODE).ids[:len(prompt)] == prompt


def test_documents_are_separated_by_end_of_text():
    tokenizer = _tokenizer()
    stream = encode_documents(tokenizer, ["a = 1\n", "b = 2\n"])
    end = tokenizer.token_to_id(END_OF_TEXT)
    assert stream.count(end) == 2 and stream[-1] == end
