"""``least-loaded``: the decode pod with the least work, the chain with the fewest queued tokens.

Decode pod: a pod reporting no free KV block is full and skipped (all full ->
RESOURCE_EXHAUSTED). Among the rest the order is sequences (running + queued; the
iteration's cost grows with them under SARATHI's budget), then queued prompt tokens, then
the most free KV blocks. The sequence count is the larger of what the pod reported and what
this gateway has in flight there, so a burst that arrives between two heartbeats spreads
over the pods instead of piling onto the one that looked emptiest.

Chain: a prompt of at least ``prefill_threshold_tokens`` goes to the live chain with the
fewest queued prompt tokens (reported, or in flight from here, whichever is larger); with
no live chain it is prefilled on the decode pod, which is slower but always works. A chain
prefills one request after another, so a burst of long prompts would queue behind it while
the decode pod's SARATHI batches sit idle: once the chain holds ``chain_max_queued_tokens``
prompt tokens not yet prefilled, the next long prompt is prefilled on its decode pod.
"""

from __future__ import annotations

from collections.abc import Mapping

from baton.gateway.routing_policy import (
    InFlight,
    NoLiveWorkers,
    RouteDecision,
    RoutingPolicy,
    WorkersFull,
    register_policy,
)
from baton.routing import RoutingSnapshot, WorkerInfo


@register_policy("least-loaded")
class LeastLoadedPolicy(RoutingPolicy):
    def route(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
              in_flight: Mapping[str, InFlight]) -> RouteDecision:
        decode = self._pick_decode(snapshot, in_flight)
        chain = None
        if num_prompt_tokens >= self.config.prefill_threshold_tokens:
            chain = self._pick_chain(num_prompt_tokens, snapshot, in_flight)
        return RouteDecision(decode=decode, chain=chain)

    def _pick_decode(self, snapshot: RoutingSnapshot, in_flight: Mapping[str, InFlight]) -> WorkerInfo:
        workers = self.decode_workers(snapshot)
        if not workers:
            raise NoLiveWorkers(f"no decode worker of model {self.model_id!r} is live")
        with_room = [w for w in workers if w.load.free_kv_blocks > 0 or w.load.total_kv_blocks == 0]
        if not with_room:
            raise WorkersFull(f"all {len(workers)} decode workers of model {self.model_id!r} are "
                              f"out of KV blocks; retry later")

        def load(worker: WorkerInfo) -> tuple:
            here = in_flight.get(worker.address, InFlight())
            sequences = max(worker.load.running_sequences + worker.load.queued_requests, here.requests)
            return (sequences, worker.load.queued_prompt_tokens, -worker.load.free_kv_blocks,
                    worker.worker_id)

        return min(with_room, key=load)

    def _pick_chain(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
                    in_flight: Mapping[str, InFlight]) -> WorkerInfo | None:
        heads = self.chain_heads(snapshot)
        if not heads:
            return None

        def queued(head: WorkerInfo) -> tuple:
            here = in_flight.get(head.address, InFlight())
            return (max(head.load.queued_prompt_tokens, here.prompt_tokens),
                    max(head.load.queued_requests, here.requests), head.chain_id)

        head = min(heads, key=queued)
        queued_tokens = queued(head)[0]
        limit = self.config.chain_max_queued_tokens
        if limit and queued_tokens > 0 and queued_tokens + num_prompt_tokens > limit:
            return None  # every chain is backed up: the decode pod prefills it sooner
        return head
