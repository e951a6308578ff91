"""PyramidInfer KV compression: fewer keys and values in deeper layers, chosen by recent attention.

The API the other engines call (all settings come from ``baton.config.PyramidConfig``;
a request's overrides from ``request_config(config, enabled=..., keep_ratio=...)``):

Prefill phase — one ``PromptCompressor`` per prompt, built by
``make = compressor_factory(config, model_config)`` then ``compressor = make(prompt_length)``:

* it is the model's attention observer while the prompt is prefilled: pass it
  as ``Segment(length, kv, observer=compressor)`` (every chunk of a chunked
  prefill, or the tail rank's slice of a KV-Runahead chain) or as
  ``baton.model.prefill(..., observer=compressor)``;
* afterwards ``compressor.compress(layers) -> layers`` returns the
  pyramid-shaped cache (``list[LayerKV]``, original positions kept), or
  ``compressor.retain_in_pool(pool, seq_id)`` compresses a sequence that is
  already in a ``KVPool``; ``compressor.budgets`` are the per-layer token counts.
* ``prefill_compressed(model, token_ids, config)`` does both in one process.

Generation phase — one ``GenerationCompressor(config, model_config)`` per decode
pool: ``observer = track(seq_id, prompt_length)`` once the prompt is in the pool,
the observer on each decode step's ``Segment``, ``after_step(pool, seq_id)`` after
each decode step, ``forget(seq_id)`` when the sequence ends.

On a SARATHI decode pod both phases come together:
``Engine(..., compressor_factory=engine_compressor_factory(config, model_config))``.
"""

from baton.pyramid.engine_hook import PyramidSequenceCompressor, engine_compressor_factory
from baton.pyramid.generation import GenerationCompressor, RecentQueries
from baton.pyramid.prefill import (
    PromptCompressor,
    check_model,
    compressor_factory,
    prefill_compressed,
    request_config,
)
from baton.pyramid.schedule import (
    BUDGET_POLICIES,
    generation_keep_counts,
    layer_budgets,
    mandatory_tokens,
    pyramid_budgets,
    recent_window,
    uniform_budgets,
)

__all__ = [
    "BUDGET_POLICIES",
    "GenerationCompressor",
    "PromptCompressor",
    "PyramidSequenceCompressor",
    "RecentQueries",
    "check_model",
    "compressor_factory",
    "engine_compressor_factory",
    "generation_keep_counts",
    "layer_budgets",
    "mandatory_tokens",
    "prefill_compressed",
    "pyramid_budgets",
    "recent_window",
    "request_config",
    "uniform_budgets",
]
