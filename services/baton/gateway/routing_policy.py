"""Where a request goes: the routing-policy interface, its result type and the registry.

Design (after Sarathi-Serve's scheduler registry): a policy is a subclass of
``RoutingPolicy`` registered under a name by ``@register_policy`` (``baton.registry``; the
names are declared in ``baton.config.GATEWAY_POLICIES``); a new policy is one new file in
``baton/gateway/policies/`` and its name there. A policy sees only the routing snapshot (the workers'
heartbeat records, possibly stale while Redis is down) and the gateway's own in-flight
counts, which cover the requests it sent since the workers' last heartbeat. It answers with
a ``RouteDecision`` or raises ``NoLiveWorkers`` (gRPC UNAVAILABLE) or ``WorkersFull``
(RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from baton.api.requests import GenerateRequest
from baton.config import GATEWAY_POLICIES, GatewayRoutingConfig
from baton.errors import InvalidArgument, ResourceExhausted, Unavailable
from baton.routing import RoutingSnapshot, WorkerInfo


class NoLiveWorkers(Unavailable, RuntimeError):
    """No worker that could serve the request is registered (not ready: UNAVAILABLE)."""


class WorkersFull(ResourceExhausted, RuntimeError):
    """Every live decode pod is out of KV blocks (RESOURCE_EXHAUSTED, answered at once)."""


@dataclass(frozen=True)
class InFlight:
    """What this gateway has sent to one address and not yet seen finish: its requests, and
    the prompt tokens among them still to be prefilled there (``RequestTable.in_flight``)."""

    requests: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class RoutedPrompt:
    """What a policy may read of the request beyond its length: a cache-aware policy hashes
    the token ids the way a decode pod's prefix cache does, under the caller's salt."""

    token_ids: tuple[int, ...]
    cache_salt: str = ""
    # Its KV will be cached whole wherever it is computed (compression off for it); with
    # compression on only the local route caches it, and only up to the pruning's window.
    whole_kv: bool = False


@dataclass(frozen=True)
class RouteDecision:
    decode: WorkerInfo
    chain: WorkerInfo | None = None  # rank 0 of the chain; None = prefill on the decode pod
    reason: str = ""  # why the prompt is prefilled where it is, for the client and the logs
    # Prompt tokens the route expects the decode pod's prefix cache to hold (cache-aware): the
    # pod prefills only the rest, which is what the request adds to its queue.
    cached_tokens: int = 0


class RoutingPolicy(abc.ABC):
    def __init__(self, config: GatewayRoutingConfig, model_id: str,
                 on_contract_mismatch: Callable[[int], None] | None = None) -> None:
        """``on_contract_mismatch(n)``: told each time a route passes over ``n`` chains whose
        KV contract the decode pod's does not fit (the gateway counts them in a metric)."""
        self.config = config
        self.model_id = model_id
        self.on_contract_mismatch = on_contract_mismatch or (lambda num_chains: None)

    @abc.abstractmethod
    def route(self, num_prompt_tokens: int, snapshot: RoutingSnapshot,
              in_flight: Mapping[str, InFlight], prefill_route: str = "auto",
              prompt: RoutedPrompt | None = None) -> RouteDecision:
        """Pick the decode pod, and a chain for a long prompt; ``in_flight`` is keyed by
        address. ``prefill_route`` is the caller's pin (``baton.api.requests.PREFILL_ROUTES``):
        "chain" raises NoLiveWorkers while no chain is live, "local" never takes one.
        ``prompt``: the request's tokens, for a policy that looks at them (None on a reroute
        after a failure, which replays more than the prompt)."""

    def decode_workers(self, snapshot: RoutingSnapshot) -> list[WorkerInfo]:
        """The live decode pods serving this gateway's model."""
        return [w for w in snapshot.of_role("decode") if w.model_id == self.model_id]

    def chain_heads(self, snapshot: RoutingSnapshot) -> list[WorkerInfo]:
        """Rank 0 of every live chain of this model. Rank 0 speaks for its chain: it registers
        only once every rank has joined and stops serving when a rank is lost."""
        return [worker for worker in snapshot.of_role("prefill")
                if worker.model_id == self.model_id and worker.rank == 0]


POLICIES = GATEWAY_POLICIES  # name -> RoutingPolicy subclass
register_policy = POLICIES.register


def create_policy(config: GatewayRoutingConfig, model_id: str,
                  on_contract_mismatch: Callable[[int], None] | None = None) -> RoutingPolicy:
    return POLICIES.get(config.policy)(config, model_id, on_contract_mismatch)


def prefill_route_of(request: GenerateRequest) -> str:
    """Where the request may be prefilled: as the caller pinned it, but on the decode pod for
    prompt log probabilities (a chain's ranks each hold a slice of the prompt's last hidden
    states, and its tail computes only the last position's logits). Every router asks this:
    the gateway's and a decode pod's own door's."""
    if request.sampling.prompt_logprobs is None:
        return request.prefill_route
    if request.prefill_route == "chain":
        raise InvalidArgument("prompt log probabilities (prompt_logprobs, or echo with logprobs) "
                              "are computed on the local route: prefill_route 'chain' cannot "
                              "give them")
    return "local"
