"""Training the byte-level BPE tokenizer of the shipped model (the `tokenizers` package).

Byte-level (GPT-2 style): every byte has a token, so any text — including the
odd non-ASCII string in the stdlib — round-trips exactly. One special token,
END_OF_TEXT, separates documents in training and is the model's eos token.

A newline is always a token of its own. GPT-2's pre-tokenizer would merge it
with the indentation that follows ("\n" + eight spaces as one token); a prompt
that ends at a line break then ends in a bare "\n" token that in training
only ever preceded column 0, and the model continues ``def f():\n`` with an
unindented line. Isolated newlines keep the indentation a separate token, so
such a prompt's last token means what it says.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from baton.train.corpus import END_OF_TEXT


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens (fewer on a tiny corpus)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> list[int]:
    """One token stream: each document's ids followed by END_OF_TEXT."""
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(end_of_text)
    return stream
