"""Prefill-phase PyramidInfer: score as each layer is computed, then cut each layer to its budget.

One ``PromptCompressor`` serves one prompt. It is the model's attention
observer while the prompt is prefilled (``Segment(..., observer=compressor)``
or ``baton.model.prefill(..., observer=compressor)``) and then turns the full
cache into a pyramid-shaped one with ``compress(layers)`` (or, in a paged
pool, ``retain_in_pool(pool, seq_id)``).

It works the same wherever the prompt's queries pass through it:

* single process: one ``prefill`` over the whole prompt;
* chunked prefill on a decode pod: the same observer on every chunk's
  segment — the recent window may span several chunks; each chunk's recent
  queries are scored against the keys they see (cached prefix + own chunk),
  which is exactly what they would see in one pass;
* the tail of a KV-Runahead chain: only the tail's own tokens pass through.
  When the recent window starts before the tail's slice, the tail scores with
  the recent queries it has (the end of the window, which carries the highest
  weights); the kept recent window itself is always the last
  ``recent_ratio`` of the prompt, whoever computed it.

Scores are accumulated per key *position* ([P] per layer), so the order in
which chunks arrive does not matter. Selection per layer: sinks + recent
window always; then the best-scored tokens up to the layer's budget; kept
tokens stay in position order with their original positions (RoPE and the
causal mask need them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from baton.config import PyramidConfig
from baton.kv import DenseKV, KVPool, LayerKV
from baton.model import CausalLM, ModelConfig, prefill
from baton.pyramid.schedule import BUDGET_POLICIES, layer_budgets, recent_window
from baton.pyramid.scoring import query_weights, recent_attention_scores, top_candidates


def request_config(config: PyramidConfig, enabled: bool | None = None,
                   keep_ratio: float | None = None) -> PyramidConfig:
    """The deployment's settings with one request's overrides (None = keep the deployment's).

    Raises ValueError naming the value when an override is out of range.
    """
    changes = {name: value for name, value in (("enabled", enabled), ("keep_ratio", keep_ratio))
               if value is not None}
    return dataclasses.replace(config, **changes) if changes else config


class PromptCompressor:
    """Attention observer + per-layer selector for one prompt of ``prompt_length`` tokens."""

    def __init__(self, config: PyramidConfig, num_layers: int, prompt_length: int,
                 sliding_window: int | None = None) -> None:
        if prompt_length < 1:
            raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
        self.config = config
        self.num_layers = num_layers
        self.prompt_length = prompt_length
        self.sliding_window = sliding_window
        self.window = recent_window(config, prompt_length)
        self.window_start = prompt_length - self.window
        self.budgets = layer_budgets(config, num_layers, prompt_length)
        self.by_attention = BUDGET_POLICIES.get(config.policy).by_attention
        self.needs_scores = self.by_attention and any(b < prompt_length for b in self.budgets)
        self._scores: list[torch.Tensor | None] = [None] * num_layers  # [P] per layer, by position
        self._compressed: dict[int, LayerKV] = {}  # compress_layer's, by layer

    # --- observer -----------------------------------------------------------------------------

    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        """Add the attention of this segment's recent-window queries (q: [T, H, D]) to the scores."""
        if not self.needs_scores:
            return
        recent = query_positions >= self.window_start
        if not bool(recent.any()):
            return
        positions = query_positions[recent]
        weights = query_weights(self.config, positions, self.window_start, self.window)
        contribution = recent_attention_scores(q[recent], positions, weights, k, key_positions,
                                               self.sliding_window)
        scores = self._scores[layer]
        if scores is None:
            scores = torch.zeros(self.prompt_length, dtype=torch.float32, device=k.device)
            self._scores[layer] = scores
        scores.index_add_(0, key_positions, contribution)

    def scores(self, layer: int) -> torch.Tensor | None:
        """[P] accumulated score of each prompt position in ``layer`` (None before any recent query)."""
        return self._scores[layer]

    # --- selection ----------------------------------------------------------------------------

    def keep_indices(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Sorted indices into one layer's tokens (original ``positions`` [S]) that it keeps."""
        budget = self.budgets[layer]
        if budget >= positions.numel():
            return torch.arange(positions.numel(), device=positions.device)
        mandatory = (positions < self.config.num_sinks) | (positions >= self.window_start)
        if self.by_attention:
            scores = self._scores[layer]
            assert scores is not None, f"layer {layer} was compressed before any recent query passed"
            token_scores = scores[positions]
        else:  # "local": the most recent tokens win
            token_scores = positions.to(torch.float32)
        chosen = top_candidates(token_scores, ~mandatory, budget - int(mandatory.sum()))
        keep = mandatory.clone()
        keep[chosen] = True
        indices = keep.nonzero().squeeze(1)
        return indices[torch.argsort(positions[indices], stable=True)]

    def select(self, layers: list[LayerKV]) -> list[torch.Tensor]:
        """Per layer, the sorted indices of the tokens kept."""
        assert len(layers) == self.num_layers, "one LayerKV per layer"
        return [self.keep_indices(index, layer.positions) for index, layer in enumerate(layers)]

    def compress(self, layers: list[LayerKV]) -> list[LayerKV]:
        """The pyramid-shaped cache: each layer cut to its budget, original positions kept."""
        assert len(layers) == self.num_layers, "one LayerKV per layer"
        return [self.compress_layer(index, layer) for index, layer in enumerate(layers)]

    def compress_layer(self, index: int, layer: LayerKV) -> LayerKV:
        """One layer cut to its budget, once its attention has been observed (a tail that
        ships layer by layer compresses each as it is done; ``compress`` reuses the cut)."""
        if index not in self._compressed:
            keep = self.keep_indices(index, layer.positions)
            self._compressed[index] = layer if keep.numel() == layer.num_tokens else LayerKV(
                layer.k[keep], layer.v[keep], layer.positions[keep])
        return self._compressed[index]

    def kept_counts(self) -> tuple[int, ...]:
        """Tokens each layer keeps of a cache holding the whole prompt (what a header
        announces before the layers exist): its budget, which the floor of sinks and recent
        window never exceeds."""
        return tuple(self.budgets)

    def retain_in_pool(self, pool: KVPool, seq_id: str) -> None:
        """Compress a sequence held in a paged pool in place (frees the emptied blocks)."""
        for layer in range(self.num_layers):
            positions = pool.gather(seq_id, layer).positions
            keep = self.keep_indices(layer, positions)
            if keep.numel() < positions.numel():
                pool.retain(seq_id, layer, keep)


def check_model(model_config: ModelConfig) -> None:
    """Raise ValueError for a model whose attention PyramidInfer cannot score: it ranks keys
    by softmax(q k / sqrt(head_dim)) under one window for every layer, and Gemma's
    per-layer windows, soft-capped scores and query_pre_attn_scalar would make it keep
    other keys than the model attends to."""
    variations = model_config.attention_variations()
    if variations:
        raise ValueError(f"PyramidInfer compression does not support {model_config.architecture}'s "
                         f"{', '.join(variations)}; turn compression off for this model")


def compressor_factory(config: PyramidConfig,
                       model_config: ModelConfig) -> Callable[[int], PromptCompressor]:
    """``make_observer(prompt_length) -> PromptCompressor`` for a chain tail or an engine."""
    check_model(model_config)
    return functools.partial(PromptCompressor, config, model_config.num_hidden_layers,
                             sliding_window=model_config.sliding_window)


def prefill_compressed(model: CausalLM, token_ids: torch.Tensor,
                       config: PyramidConfig) -> tuple[torch.Tensor, list[LayerKV]]:
    """Single-process prefill of a whole prompt -> (last token's logits [vocab], compressed cache)."""
    prompt_length = token_ids.shape[0]
    compressor = compressor_factory(config, model.config)(prompt_length)
    kv = DenseKV(model.config.num_hidden_layers)
    positions = torch.arange(prompt_length, device=token_ids.device)
    logits = prefill(model, token_ids, positions, kv, observer=compressor)
    return logits, compressor.compress(kv.complete_layers())
