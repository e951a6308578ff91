"""PyramidInfer on a decode pod: the adapter the SARATHI engine's compression seam takes.

One ``SequenceCompressor`` per sequence (``baton.sarathi.hooks``), built by the
factory from the deployment's ``PyramidConfig`` and the request's overrides
(``SamplingParams.compression``):

* prompt phase — while the prompt is prefilled locally (chunk by chunk), each
  chunk's queries go to a ``PromptCompressor``; after the final chunk the
  engine calls ``compress(layers)`` and stores the pyramid-shaped cache;
* generation phase — decode steps' queries (every layer's at once, from the
  decode batch) go to a ``RecentQueries`` ring buffer and ``after_decode``
  prunes every 16 tokens that leave the recent window (``GenerationCompressor``).

With a prefix-cache hit the cached prompt tokens never pass ``observe``: the hit
ends where the recent window begins (``cacheable_tokens``), so every query that
scores is computed here, against all the keys (cached ones included), exactly as
without the hit.

The phase of a query is read off its position: positions inside the prompt
belong to the prompt, later ones are generated tokens. So a request whose
prompt KV came from a prefill chain (already compressed at the tail) goes
straight to the generation phase with the same object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from baton.config import PyramidConfig
from baton.kv import KVPool, LayerKV
from baton.model import ModelConfig
from baton.pyramid.generation import GenerationCompressor, RecentQueries
from baton.pyramid.prefill import PromptCompressor, check_model, request_config
from baton.pyramid.schedule import recent_window
from baton.sampling.params import SamplingParams


class PyramidSequenceCompressor:
    def __init__(self, config: PyramidConfig, model_config: ModelConfig, prompt_length: int) -> None:
        self.prompt_length = prompt_length
        self._prompt = PromptCompressor(config, model_config.num_hidden_layers, prompt_length,
                                        model_config.sliding_window)
        # One generation compressor per sequence: its state dies with the sequence.
        self._generation = GenerationCompressor(config, model_config)
        self._recent = RecentQueries(model_config.num_hidden_layers,
                                     recent_window(config, prompt_length))
        self._tracked_id: str | None = None

    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        if query_positions[0].item() < self.prompt_length:
            self._prompt.observe(layer, q, query_positions, k, key_positions)
            return
        self._recent.observe(layer, q, query_positions, k, key_positions)

    def observe_decode(self, queries: torch.Tensor, position: int) -> None:
        self._recent.observe_decode(queries, position)

    def cacheable_tokens(self) -> int:
        # Selection reads the scores of the recent window's queries against every key: those
        # queries must be computed here, the keys before the window may come from the cache.
        return self._prompt.window_start if self._prompt.needs_scores else self.prompt_length

    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        return self._prompt.compress(layers)

    def after_decode(self, pool: KVPool, seq_id: str) -> None:
        if self._tracked_id != seq_id:  # the tracker is keyed by the pool's sequence id
            self._generation.adopt(seq_id, self._recent, self.prompt_length)
            self._tracked_id = seq_id
        self._generation.after_step(pool, seq_id)


def engine_compressor_factory(config: PyramidConfig, model_config: ModelConfig
                              ) -> Callable[[list[int], SamplingParams], PyramidSequenceCompressor | None]:
    """``factory(token_ids, params)`` for ``baton.sarathi.Engine``: None when the request
    (or the deployment, unless the request turns it on) runs without compression. Raises
    ValueError at once, when the deployment compresses, for a model it cannot compress."""
    if config.enabled:
        check_model(model_config)

    def factory(token_ids: list[int], params: SamplingParams) -> PyramidSequenceCompressor | None:
        settings = request_config(config, params.compression.enabled, params.compression.keep_ratio)
        if not settings.enabled:
            return None
        check_model(model_config)
        return PyramidSequenceCompressor(settings, model_config, len(token_ids))

    return factory
