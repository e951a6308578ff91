"""``cache-aware``: the decode pod that gives the prompt its first token soonest, counting what
its prefix cache already holds; a chain only for what no pod has cached.

Decode pod: each pod's cost is the prompt tokens it would have to compute before this
prompt's first token — those queued there (reported, or in flight from here, whichever is
larger) plus this prompt's tokens its cache does not hold (``PrefixIndex``, fed by the pods'
published cache events) — divided by the prefill rate it advertises (prompt tokens a second
over its recent steps, decodes riding along, so a busy pod is a slower one). A pod that has
not measured a rate yet is given the best rate measured by any pod. Pods out of KV blocks
are skipped, as with ``least-loaded``; ties go to the least-loaded order.

Chain or cache: a prompt at least ``prefill_threshold_tokens`` long goes to a chain (chosen
as ``least-loaded`` chooses) only when what the best pod lacks is itself that long (and, with
``chain_break_even``, at least the chain's break-even): a chain prefills the whole prompt, so
it pays only for the tokens nobody holds. Otherwise the pod holding the prefix prefills the
rest, and the route's reason names the hit.

Right after routing a prompt to a pod the index expects that pod to hold its blocks
(``PrefixIndex.expect``) until the pod's own events say so or the expectation lapses, so a
burst of prompts sharing a prefix lands on one pod instead of computing it everywhere: for
a prompt prefilled there, and for one whose chain-computed KV it will cache (compression off).
Routing and expecting happen under one lock, so concurrent requests see each other's.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from baton.gateway.policies.least_loaded import LeastLoadedPolicy
from baton.gateway.routing_policy import (
    InFlight,
    RouteDecision,
    RoutedPrompt,
    register_policy,
)
from baton.routing import RoutingSnapshot, WorkerInfo
from baton.routing.prefix_index import prompt_hashes

UNMEASURED_RATE = 1000.0  # prompt tokens a second assumed while no pod has measured its own


@register_policy("cache-aware")
class CacheAwarePolicy(LeastLoadedPolicy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._routing = threading.Lock()

    def route(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
              in_flight: Mapping[str, InFlight], prefill_route: str = "auto",
              prompt: RoutedPrompt | None = None) -> RouteDecision:
        if prompt is None or snapshot.prefixes is None or prefill_route == "chain":
            return super().route(num_prompt_tokens, snapshot, in_flight, prefill_route, prompt)
        with self._routing:
            return self._route(num_prompt_tokens, snapshot, in_flight, prefill_route, prompt)

    def _route(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
               in_flight: Mapping[str, InFlight], prefill_route: str,
               prompt: RoutedPrompt) -> RouteDecision:
        decode, cached = self._pick_cached(prompt, snapshot, in_flight)
        hashes = prompt_hashes(decode, prompt.token_ids, prompt.cache_salt)
        threshold = self.config.prefill_threshold_tokens
        uncached = num_prompt_tokens - cached
        # Without a hit the reason reads as least-loaded's; with one it starts with the hit.
        hit = f"prefix cache: {cached} of {num_prompt_tokens} prompt tokens cached on {decode.address}"
        length = f"{hit}; {uncached} uncached tokens" if cached else f"prompt of {num_prompt_tokens} tokens"
        chain = None
        if prefill_route == "local":
            reason = "prefill_route local: prefilled on the decode pod" + (f"; {hit}" if cached else "")
        elif uncached < threshold:
            reason = f"{length} < prefill_threshold_tokens {threshold}: prefilled on the decode pod"
        else:
            chain, why = self._pick_chain(uncached, snapshot, in_flight, decode)
            if chain is None:
                why += ": prefilled on the decode pod"
            reason = f"{length} >= prefill_threshold_tokens {threshold}: {why}"
        if chain is None or prompt.whole_kv:  # the pod will hold the prompt's blocks
            snapshot.prefixes.expect(decode, hashes)
        return RouteDecision(decode, chain, reason, cached_tokens=cached)

    def _pick_cached(self, prompt: RoutedPrompt, snapshot: RoutingSnapshot,
                     in_flight: Mapping[str, InFlight]) -> tuple[WorkerInfo, int]:
        """The pod with the soonest first token, and the prompt tokens it holds cached."""
        with_room = self.decode_with_room(snapshot)
        measured = [w.load.prefill_tokens_per_s for w in with_room if w.load.prefill_tokens_per_s > 0]
        default_rate = max(measured, default=UNMEASURED_RATE)
        num_tokens = len(prompt.token_ids)

        def cost(worker: WorkerInfo) -> tuple:
            cached = self._cached_tokens(worker, prompt, snapshot)
            here = in_flight.get(worker.address, InFlight())
            queued = max(worker.load.queued_prompt_tokens, here.prompt_tokens)
            rate = worker.load.prefill_tokens_per_s or default_rate
            sequences = max(worker.load.running_sequences + worker.load.queued_requests, here.requests)
            return ((queued + num_tokens - cached) / rate, sequences, -worker.load.free_kv_blocks,
                    worker.worker_id), cached

        best = min(with_room, key=lambda worker: cost(worker)[0])
        return best, cost(best)[1]

    @staticmethod
    def _cached_tokens(worker: WorkerInfo, prompt: RoutedPrompt, snapshot: RoutingSnapshot) -> int:
        """Prompt tokens the pod's cache holds (its last token is always computed)."""
        hashes = prompt_hashes(worker, prompt.token_ids, prompt.cache_salt)
        usable = (len(prompt.token_ids) - 1) // worker.kv_block_size if worker.kv_block_size else 0
        return snapshot.prefixes.matched_blocks(worker, hashes[:usable]) * worker.kv_block_size
