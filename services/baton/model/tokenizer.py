"""The tokenizer of a checkpoint (``tokenizer.json`` through the `tokenizers` package)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from baton.model.errors import CheckpointError


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenizer:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(str(path), "tokenizer.json", "file not found")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers package raises a bare Exception
            raise CheckpointError(str(path), "tokenizer.json", f"cannot be parsed: {e}") from e

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's ids; with ``add_special_tokens`` the tokenizer's own additions too (a
        Llama tokenizer's BOS), as vLLM encodes a completion's prompt."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (grammar libraries read their token
        tables from it)."""
        return self._tokenizer.to_str()


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas for streaming.

    Byte-level BPE can split one UTF-8 character over several tokens; a delta
    is released only once it no longer ends in a replacement character.

    Each push decodes a window, not the whole output (which made a long generation
    quadratic): the tokens not yet released, after the tokens of the last release as
    context (how a tokenizer renders a token can depend on what precedes it, e.g. a
    leading space), as vLLM's detokenizer does. The delta is what the window's text adds
    to its context's text; should a tokenizer ever render the context differently inside
    the window, the whole output is decoded instead.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._emitted = ""
        self._context = 0  # the window starts here: the tokens of the last release
        self._released = 0  # tokens whose text has been emitted

    @property
    def text(self) -> str:
        return self._emitted

    def push(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self._token_ids
        context = self._tokenizer.decode(ids[self._context:self._released], self._skip_special_tokens)
        window = self._tokenizer.decode(ids[self._context:], self._skip_special_tokens)
        if not window.startswith(context):
            return self._release_whole(final)
        if not final and window.endswith("\ufffd"):
            return ""
        delta = window[len(context):]
        if delta or final:
            self._context, self._released = self._released, len(ids)
        self._emitted += delta
        return delta

    def _release_whole(self, final: bool) -> str:
        text = self._tokenizer.decode(self._token_ids, self._skip_special_tokens)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text if text.startswith(self._emitted) else self._emitted
        self._context, self._released = self._released, len(self._token_ids)
        return delta
