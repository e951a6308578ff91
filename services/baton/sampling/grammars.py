"""The structured-output grammars of one model's requests, wherever a token is drawn under
one (a decode pod's engine, a chain's tail, the gateway checking a request).

The compiler needs the model's tokenizer, which a chain's ranks do not load for themselves:
it is read when the first request with a grammar comes (``load_tokenizer``), and the grammar
library is imported then too, so a deployment that never constrains never pays for either.
A request's state is a fresh matcher advanced over the tokens the request already generated
(a stream that moved here replays them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from baton.model.tokenizer import Tokenizer
from baton.sampling.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarState,
    TokenizerInfo,
)


class ModelGrammars:
    def __init__(self, load_tokenizer: Callable[[], Tokenizer | None], vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec compiled (cached); GrammarError (a ValueError) says why it cannot be."""
        return self._compiler_or_load().compile(spec)

    def state(self, spec: GrammarSpec, generated: Sequence[int] = ()) -> GrammarState:
        """A matcher for one request, past the tokens it generated so far."""
        state = self.compile(spec).new_state()
        if generated and not state.replay(list(generated)):
            raise GrammarError(f"the tokens generated so far do not follow the grammar: "
                               f"{state.error}")
        return state

    def _compiler_or_load(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise GrammarError("structured outputs need the model's tokenizer, and this "
                                       "model has none")
                self._compiler = GrammarCompiler(TokenizerInfo.from_model(
                    tokenizer, self.vocab_size, self.eos_token_ids))
            return self._compiler
