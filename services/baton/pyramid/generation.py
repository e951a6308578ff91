"""Generation-phase PyramidInfer: keep long generations' KV bounded on the decode pod.

During decoding every new token enters a sliding recent window of W tokens
(W = the prompt's recent window, fixed for the request). Tokens that leave
the window are held back until ``generation_update_every`` (16) of them have
left; then the batch is scored by the attention of the recent decode queries
(the last W queries seen by this sequence's decode steps, weighted like the
prompt's: newest heaviest, all heads averaged) and each layer keeps its best
``generation_keep_counts`` of them (0.9 of the batch at layer 0 falling to 0.1
at the last layer). Everything else in the cache stays. A layer holding fewer
than ``min_context`` tokens is left alone.

So a layer grows by at most its keep fraction per generated token instead of
one token: after n generated tokens layer l holds about
``prefill_budget_l + W + keep_l / 16 * n`` tokens (+ < 16 not yet scored).

How an engine uses it (one instance per decode pool):

    observer = compressor.track(seq_id, prompt_length)   # once the prompt is in the pool
    DecodeBatch(step, [observer, ...])                    # on each decode step (or a
    Segment(1, pool.view(seq_id), observer)               #   step's segment of one token)
    compressor.after_step(pool, seq_id)                   # after each decode step
    compressor.forget(seq_id)                             # when the sequence finishes
"""

from __future__ import annotations

import torch

from baton.config import PyramidConfig
from baton.kv import KVPool
from baton.model import ModelConfig
from baton.pyramid.schedule import generation_keep_counts, recent_window
from baton.pyramid.scoring import query_weights, recent_attention_scores, top_candidates


class RecentQueries:
    """Observer of one sequence's decode steps: a ring buffer of its last W queries, every
    layer's, slot = position mod W."""

    def __init__(self, num_layers: int, window: int) -> None:
        self.window = window
        self.num_layers = num_layers
        self._queries: torch.Tensor | None = None  # [W, layers, H, D]
        # each slot's position (-1 = empty), a list: a decode step writes one slot, and a
        # list item is cheaper to write than a tensor's (thousands of writes a step)
        self._positions: list[int] = [-1] * window
        self.newest_position = -1

    def observe_decode(self, queries: torch.Tensor, position: int) -> None:
        """A decode batch's row: the token's queries of every layer ([layers, H, D])."""
        if self._queries is None:
            self._queries = queries.new_zeros((self.window,) + tuple(queries.shape))
        slot = position % self.window
        self._queries[slot] = queries
        self._positions[slot] = position
        self.newest_position = max(self.newest_position, position)

    def observe(self, layer: int, q: torch.Tensor, query_positions: torch.Tensor,
                k: torch.Tensor, key_positions: torch.Tensor) -> None:
        """A segment's rows, one layer (a decode step taken as a segment of one token)."""
        if self._queries is None:
            self._queries = q.new_zeros((self.window, self.num_layers) + tuple(q.shape[1:]))
        for row, position in enumerate(query_positions.tolist()):
            slot = position % self.window
            self._queries[slot, layer] = q[row]
            self._positions[slot] = position
            self.newest_position = max(self.newest_position, position)

    def recent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [R, layers, H, D], positions [R]) of the last W decode steps, R <= W."""
        if self._queries is None:
            return torch.empty(0), torch.empty(0, dtype=torch.int64)
        positions = torch.tensor(self._positions, dtype=torch.int64, device=self._queries.device)
        filled = (positions >= 0) & (positions > self.newest_position - self.window)
        return self._queries[filled], positions[filled]


class _Sequence:
    def __init__(self, observer: RecentQueries, next_unscored: int) -> None:
        self.observer = observer
        self.next_unscored = next_unscored  # first position that has not been scored yet


class GenerationCompressor:
    """The generation-phase update for every sequence of one decode pool."""

    def __init__(self, config: PyramidConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.num_layers = model_config.num_hidden_layers
        self.sliding_window = model_config.sliding_window
        self.batch = config.generation_update_every
        self.keep_counts = generation_keep_counts(config, self.num_layers)
        self._sequences: dict[str, _Sequence] = {}

    def track(self, seq_id: str, prompt_length: int) -> RecentQueries:
        """Start updating a sequence whose prompt (compressed or not) is in the pool."""
        observer = RecentQueries(self.num_layers, recent_window(self.config, prompt_length))
        self.adopt(seq_id, observer, prompt_length)
        return observer

    def adopt(self, seq_id: str, observer: RecentQueries, prompt_length: int) -> None:
        """Track a sequence with an observer that has already been recording its decode steps."""
        # The prompt's recent window was kept whole; it is the first to leave the sliding window.
        first = max(prompt_length - observer.window, self.config.num_sinks)
        self._sequences[seq_id] = _Sequence(observer, first)

    def observer(self, seq_id: str) -> RecentQueries | None:
        tracked = self._sequences.get(seq_id)
        return tracked.observer if tracked else None

    def forget(self, seq_id: str) -> None:
        self._sequences.pop(seq_id, None)

    def after_step(self, pool: KVPool, seq_id: str) -> int:
        """Prune every full batch that has left the window; returns the tokens dropped (all layers)."""
        tracked = self._sequences.get(seq_id)
        if tracked is None:
            return 0
        observer = tracked.observer
        window_start = observer.newest_position - observer.window + 1
        dropped = 0
        while window_start - tracked.next_unscored >= self.batch:
            dropped += self._prune_batch(pool, seq_id, tracked.observer, tracked.next_unscored)
            tracked.next_unscored += self.batch
        return dropped

    def _prune_batch(self, pool: KVPool, seq_id: str, observer: RecentQueries, first: int) -> int:
        """Score the batch of positions [first, first + batch) in every layer and keep each
        layer's best. A layer's tokens are in position order (the pool appends them in order
        and pruning keeps it), so the batch is one run of them, [start, end)."""
        queries, query_positions = observer.recent()  # every layer's, read once for the batch
        if queries.shape[0] == 0:
            return 0
        weights = query_weights(self.config, query_positions,
                                observer.newest_position - observer.window + 1, observer.window)
        bounds = torch.tensor([first, first + self.batch])
        dropped = 0
        for layer in range(self.num_layers):
            keys, positions = pool.keys(seq_id, layer)
            count = positions.numel()
            start, end = torch.searchsorted(positions, bounds.to(positions.device)).tolist()
            if count < self.config.min_context or end - start <= self.keep_counts[layer]:
                continue  # too short to prune, or the batch keeps every token it has here
            scores = recent_attention_scores(queries[:, layer], query_positions, weights, keys,
                                             positions, self.sliding_window)
            everyone = torch.ones(end - start, dtype=torch.bool, device=scores.device)
            best = top_candidates(scores[start:end], everyone, self.keep_counts[layer])
            chosen = start + best.sort().values
            keep = torch.cat([torch.arange(start, device=chosen.device), chosen,
                              torch.arange(end, count, device=chosen.device)])
            dropped += end - start - self.keep_counts[layer]
            pool.retain(seq_id, layer, keep)
        return dropped
