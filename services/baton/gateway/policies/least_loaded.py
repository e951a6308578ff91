"""``least-loaded``: the decode pod with the least work, the chain with the fewest queued tokens.

Decode pod: a pod reporting no free KV block is full and skipped (all full ->
RESOURCE_EXHAUSTED). Among the rest the order is sequences (running + queued; the
iteration's cost grows with them under SARATHI's budget), then queued prompt tokens, then
the most free KV blocks. The sequence count is the larger of what the pod reported and what
this gateway has in flight there, so a burst that arrives between two heartbeats spreads
over the pods instead of piling onto the one that looked emptiest.

Chain: a prompt of at least ``prefill_threshold_tokens`` goes to the live chain with the
fewest queued prompt tokens (reported, or in flight from here, whichever is larger); with
no live chain it is prefilled on the decode pod, which is slower but always works. Only a
chain whose KV contract fits the decode pod's (``baton.kv.contract``: model revision,
KV dtype, layout, compression) is a candidate; the reason names every chain passed over and
its mismatch, and a prompt pinned to a chain goes to the least loaded pod some chain fits. With
``chain_break_even`` (the default) only the chains whose advertised break-even the prompt
reaches are candidates: below the length from which its partition table measured a chain to
beat one process, parallel prefill costs more than it saves (KV-Runahead's appendix B). A chain
prefills one request after another, so a burst of long prompts would queue behind it while
the decode pod's SARATHI batches sit idle: once the chain holds ``chain_max_queued_tokens``
prompt tokens not yet prefilled, the next long prompt is prefilled on its decode pod.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from baton.gateway.routing_policy import (
    InFlight,
    NoLiveWorkers,
    RouteDecision,
    RoutedPrompt,
    RoutingPolicy,
    WorkersFull,
    register_policy,
)
from baton.routing import RoutingSnapshot, WorkerInfo


@register_policy("least-loaded")
class LeastLoadedPolicy(RoutingPolicy):
    def route(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
              in_flight: Mapping[str, InFlight], prefill_route: str = "auto",
              prompt: RoutedPrompt | None = None) -> RouteDecision:
        decode = self._pick_decode(snapshot, in_flight)
        threshold = self.config.prefill_threshold_tokens
        if prefill_route == "local":
            return RouteDecision(decode, None, "prefill_route local: prefilled on the decode pod")
        if prefill_route == "chain":
            decode = self._pick_decode(snapshot, in_flight, fitting=self._fit_by_a_chain(snapshot))
            chain, why = self._pick_chain(0, snapshot, in_flight, decode)  # pinned: no queue limit
            if chain is None:
                raise NoLiveWorkers(f"prefill_route chain, but {why}")
            return RouteDecision(decode, chain, f"prefill_route chain: {why}")
        if num_prompt_tokens < threshold:
            return RouteDecision(decode, None, f"prompt of {num_prompt_tokens} tokens < "
                                               f"prefill_threshold_tokens {threshold}: prefilled "
                                               f"on the decode pod")
        chain, why = self._pick_chain(num_prompt_tokens, snapshot, in_flight, decode)
        if chain is None:
            why += ": prefilled on the decode pod"
        return RouteDecision(decode, chain, f"prompt of {num_prompt_tokens} tokens >= "
                                            f"prefill_threshold_tokens {threshold}: {why}")

    def decode_with_room(self, snapshot: RoutingSnapshot) -> list[WorkerInfo]:
        """The live decode pods that report a free KV block (NoLiveWorkers without any pod,
        WorkersFull when every pod is full)."""
        workers = self.decode_workers(snapshot)
        if not workers:
            raise NoLiveWorkers(f"no decode worker of model {self.model_id!r} is live")
        with_room = [w for w in workers if w.load.free_kv_blocks > 0 or w.load.total_kv_blocks == 0]
        if not with_room:
            raise WorkersFull(f"all {len(workers)} decode workers of model {self.model_id!r} are "
                              f"out of KV blocks; retry later")
        return with_room

    def _pick_decode(self, snapshot: RoutingSnapshot, in_flight: Mapping[str, InFlight],
                     fitting: Callable[[WorkerInfo], bool] | None = None) -> WorkerInfo:
        """The least loaded pod with room; among those ``fitting`` when any does."""
        with_room = self.decode_with_room(snapshot)
        if fitting is not None:
            with_room = [worker for worker in with_room if fitting(worker)] or with_room

        def load(worker: WorkerInfo) -> tuple:
            here = in_flight.get(worker.address, InFlight())
            sequences = max(worker.load.running_sequences + worker.load.queued_requests, here.requests)
            return (sequences, worker.load.queued_prompt_tokens, -worker.load.free_kv_blocks,
                    worker.worker_id)

        return min(with_room, key=load)

    def _pick_chain(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
                    in_flight: Mapping[str, InFlight], decode: WorkerInfo
                    ) -> tuple[WorkerInfo | None, str]:
        """The chain for a prompt of ``num_prompt_tokens`` (0: pinned, no break-even or queue
        limit) whose cache ``decode`` takes, or None and why not, in words."""
        heads = self.chain_heads(snapshot)
        if not heads:
            return None, f"no chain of model {self.model_id!r} is live"
        mismatched = {head.chain_id: head.contract.mismatches(decode.contract) for head in heads}
        skipped = "; ".join(f"chain {chain_id} skipped: {', '.join(why)}"
                            for chain_id, why in mismatched.items() if why)
        heads = [head for head in heads if not mismatched[head.chain_id]]
        if skipped:
            self.on_contract_mismatch(len(mismatched) - len(heads))
        if not heads:  # a rollout in progress, or pods that resolved dtype auto differently
            return None, (f"no live chain ships KV decode pod {decode.address} takes "
                          f"({skipped})")
        if num_prompt_tokens:
            worth = [head for head in heads
                     if num_prompt_tokens >= self.config.chain_takes_from(head.break_even_tokens)]
            if not worth:  # only with chain_break_even: route() checked the threshold before
                least = min(heads, key=lambda head: (head.break_even_tokens, head.chain_id))
                return None, (f"below the break-even of every chain (chain {least.chain_id}: "
                              f"{least.break_even_tokens} tokens, measured in its partition "
                              f"table)")
            heads = worth

        def queued(head: WorkerInfo) -> tuple:
            here = in_flight.get(head.address, InFlight())
            return (max(head.load.queued_prompt_tokens, here.prompt_tokens),
                    max(head.load.queued_requests, here.requests), head.chain_id)

        head = min(heads, key=queued)
        queued_tokens = queued(head)[0]
        limit = self.config.chain_max_queued_tokens
        if limit and num_prompt_tokens and queued_tokens > 0 and queued_tokens + num_prompt_tokens > limit:
            # every chain is backed up: the decode pod prefills it sooner
            return None, (f"the least busy chain holds {queued_tokens} queued tokens (+{num_prompt_tokens} "
                          f"> chain_max_queued_tokens {limit})")
        return head, f"chain {head.chain_id}" + (f" ({skipped})" if skipped else "")

    def _fit_by_a_chain(self, snapshot: RoutingSnapshot) -> Callable[[WorkerInfo], bool]:
        """Whether a decode pod's KV contract fits some live chain's."""
        contracts = [head.contract for head in self.chain_heads(snapshot)]
        return lambda decode: any(not contract.mismatches(decode.contract) for contract in contracts)
