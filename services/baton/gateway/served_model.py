"""What the gateway knows of the model it serves: its card, its tokenizer and its limits.

The gateway never loads weights: ``config.json`` and ``tokenizer.json`` are enough to answer
Tokenize and ListModels locally and to check a prompt before it reaches any pod (an
oversized or out-of-vocabulary prompt is INVALID_ARGUMENT here, with the numbers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from baton.api.requests import (
    GenerateRequest,
    ModelInfo,
    Tokenization,
    check_prompt_text,
)
from baton.config import ModelSourceConfig
from baton.config.model import served_model_names
from baton.errors import NotFound
from baton.model.config import ModelConfig
from baton.model.generation_config import GenerationConfig
from baton.model.hub import resolve_model
from baton.model.tokenizer import Tokenizer
from baton.sampling.grammars import ModelGrammars
from baton.sampling.limits import check_prompt


class UnknownModel(NotFound):
    """A request names a model this gateway does not serve."""


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    tokenizer: Tokenizer
    config: ModelConfig
    directory: Path
    names: tuple[str, ...] = ()  # every name it answers to; info.id, the first, is reported
    # the checkpoint's own name (its directory's, or the repo id): what the pods register
    # under, whatever clients call it
    model_id: str = ""
    # generation_config.json's temperature, top_p and top_k: a request that leaves one out
    sampling_defaults: dict = field(default_factory=dict)

    @functools.cached_property
    def grammars(self) -> ModelGrammars:
        """Structured outputs' grammars, compiled at the door: a bad one is the client's 400."""
        return ModelGrammars(lambda: self.tokenizer, self.config.vocab_size,
                             self.config.eos_token_ids)

    @classmethod
    def load(cls, source: ModelSourceConfig) -> ServedModel:
        """Read a checkpoint directory's config and tokenizer (empty path = the shipped model);
        raises ValueError naming a missing directory."""
        files = resolve_model(source.path, source.revision)
        directory = files.directory
        config = ModelConfig.from_file(directory / "config.json")
        config.cap_context(source.max_model_len)
        names = served_model_names(source, files.name)
        info = ModelInfo(id=names[0], revision=files.revision,
                         vocab_size=config.vocab_size,
                         max_model_len=config.max_position_embeddings,
                         num_layers=config.num_hidden_layers)
        return cls(info=info, tokenizer=Tokenizer.from_dir(directory), config=config,
                   directory=directory, names=names, model_id=files.name,
                   sampling_defaults=GenerationConfig.from_dir(directory).sampling)

    def check_name(self, name: str) -> None:
        if name and name not in (self.names or (self.info.id,)):
            served = ", ".join(repr(served) for served in self.names or (self.info.id,))
            raise UnknownModel(f"unknown model {name!r}; this gateway serves {served}")

    def prompt_ids(self, request: GenerateRequest) -> tuple[int, ...]:
        """The request's prompt as token ids, checked against the vocabulary and the context."""
        self.check_name(request.model)
        if request.text is not None:
            token_ids = self.encode_text(request.text)
        else:
            token_ids = tuple(request.token_ids or ())
        check_prompt(token_ids, request.sampling, self.info.vocab_size, self.info.max_model_len)
        return token_ids

    def encode_text(self, text: str, add_special_tokens: bool = False) -> tuple[int, ...]:
        """A text prompt's token ids; refused (TooLarge) before tokenizing when it is too
        large for the context, and (ValueError) when it has no tokens."""
        check_prompt_text(text, self.info.max_model_len)
        token_ids = tuple(self.tokenizer.encode(text, add_special_tokens))
        if not token_ids:
            raise ValueError(f"the prompt {text[:80]!r} has no tokens")
        return token_ids

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what log probabilities name)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def tokenize(self, model: str, text: str) -> Tokenization:
        self.check_name(model)
        check_prompt_text(text, self.info.max_model_len)
        token_ids = self.tokenizer.encode(text)
        return Tokenization(token_ids=tuple(token_ids),
                            pieces=tuple(self.tokenizer.decode([token]) for token in token_ids))
