"""What a decode pod tells the world about its load, once per engine step: free and total KV
blocks, running sequences, queued requests and prompt tokens, and the prefill rate it
advertises (``WorkerLoad``: read by ``Stats``, the heartbeat and the gateway's routing),
the metrics' gauges, and the prefix cache's events (for cache-aware routing). Only the
engine's loop thread calls it: the load is a snapshot it takes, never a read of the
scheduler's queues from another thread.
"""

from __future__ import annotations

import dataclasses

from baton.metrics import DecodeMetrics
from baton.routing.prefix_index import PrefixPublisher
from baton.routing.store import WorkerLoad
from baton.sarathi.engine import Engine

PREFILL_RATE_WEIGHT = 0.2  # the newest step's share of the advertised prefill rate


class LoadReport:
    def __init__(self, engine: Engine, metrics: DecodeMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._prefix_mark = (0, 0)  # the prefix cache's (lookups, last event) last published
        self._prefill_rate = 0.0  # prompt tokens a second (see measure_prefill)
        # Set by the pod: where the prefix cache's events go (for cache-aware routing).
        self.prefix_publisher: PrefixPublisher | None = None
        self.load = WorkerLoad(free_kv_blocks=engine.pool.num_free_blocks,
                               total_kv_blocks=engine.pool.num_blocks)
        metrics.kv_blocks_total.set(engine.pool.num_blocks)
        # A pool block holds block_size tokens of one layer; vLLM's, of every layer.
        metrics.vllm.record_cache_config(engine.pool.block_size,
                                         engine.pool.num_blocks // engine.pool.num_layers,
                                         engine.pool.prefix_cache is not None)

    def publish(self) -> None:
        """The load after a step."""
        scheduler = self.engine.scheduler
        pool = self.engine.pool
        waiting = list(scheduler.waiting)
        queued_tokens = sum(seq.num_uncomputed for seq in waiting + scheduler.prefilling)
        self.load = WorkerLoad(free_kv_blocks=pool.num_free_blocks, total_kv_blocks=pool.num_blocks,
                               running_sequences=scheduler.num_active,
                               queued_requests=len(waiting), queued_prompt_tokens=queued_tokens,
                               prefill_tokens_per_s=round(self._prefill_rate, 1))
        self.metrics.queued_requests.set(len(waiting))
        self.metrics.queued_prompt_tokens.set(queued_tokens)
        self.metrics.running_sequences.set(scheduler.num_active)
        self.metrics.kv_blocks_used.set(pool.num_used_blocks)
        self.metrics.vllm.record_scheduler(len(waiting), scheduler.num_active,
                                           pool.num_used_blocks / pool.num_blocks,
                                           self.engine.num_preemptions)
        cache = pool.prefix_cache
        if cache is not None and (cache.stats.lookups, cache.last_event) != self._prefix_mark:
            published = self._prefix_mark[1]
            self._prefix_mark = (cache.stats.lookups, cache.last_event)  # changed: admission or events
            self.metrics.record_prefix_cache(dataclasses.replace(cache.stats), cache.num_cached_blocks)
            if self.prefix_publisher is not None and cache.last_event != published:
                self._publish_prefix_events(cache, published)

    def measure_prefill(self, step_s: float) -> None:
        """The prefill rate the pod advertises: prompt tokens over step time, decodes and all,
        averaged over the steps that prefilled (old ones fade with ``PREFILL_RATE_WEIGHT``)."""
        plan = self.engine.last_plan
        if plan is None or not plan.prefills or step_s <= 0:
            return
        rate = plan.num_prefill_tokens / step_s
        self._prefill_rate = (rate if not self._prefill_rate else
                              PREFILL_RATE_WEIGHT * rate + (1 - PREFILL_RATE_WEIGHT) * self._prefill_rate)

    def _publish_prefix_events(self, cache, published: int) -> None:
        """Hand the cache's events after ``published`` to the publisher (the engine thread's
        only part: no store call here); a snapshot when the journal no longer has them all."""
        events = cache.events_after(published)
        if not events or events[0].sequence != published + 1:
            self.prefix_publisher.offer_snapshot(cache.last_event, [h.hex() for h in cache.hashes()])
            return
        self.prefix_publisher.offer([(e.sequence, e.stored, e.hash.hex()) for e in events])
