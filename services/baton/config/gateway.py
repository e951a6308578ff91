"""How the gateway routes a request: its policy, chains, waits and failures."""

from __future__ import annotations

from baton.configtree import require, setting, settings
from baton.registry import Registry

# One module per policy in baton/gateway/policies, registered there with @register_policy.
GATEWAY_POLICIES = Registry("gateway policy", ("cache-aware", "least-loaded"),
                            home="baton.gateway.policies.{module}")
CHAIN_FAILURE_POLICIES = ("recompute", "fail")


@settings("gateway")
class GatewayRoutingConfig:
    prefill_threshold_tokens: int = setting(512, "prompts at least this long go through a prefill chain",
                                            minimum=1)
    chain_break_even: bool = setting(True, "send a chain only prompts at least as long as its break-even: "
                                     "the length from which its partition table measured it to prefill "
                                     "faster than one process (KV-Runahead's appendix B; the chain "
                                     "advertises it); false = prefill_threshold_tokens alone decides")
    chain_max_queued_tokens: int = setting(4096, "a chain already holding this many prompt tokens not yet "
                                           "prefilled takes no more: the prompt is prefilled on its decode "
                                           "pod instead (a chain prefills one request at a time); 0 = no limit",
                                           minimum=0)
    policy: str = setting("cache-aware", "how the gateway picks pods: cache-aware = the decode pod "
                          "with the soonest first token, counting the prompt tokens its prefix "
                          "cache holds, and a chain only for what no pod holds; least-loaded = "
                          "the decode pod with the fewest sequences, then queued prompt tokens, "
                          "then the most free KV blocks (none free = full); both: the chain with "
                          "the fewest queued tokens",
                          choices=GATEWAY_POLICIES)
    kv_wait_s: float = setting(60.0, "how long a decode pod waits for the KV a chain pushes",
                               exclusive_minimum=0)
    migration_limit: int = setting(3, "times one request's stream moves to another decode pod when its "
                                   "pod fails mid-stream (prompt + tokens sent are replayed there); 0 = never",
                                   minimum=0)
    chain_failure: str = setting("recompute", "when a chain fails a request (a rank died, timed out, or its "
                                 "KV push failed): recompute = prefill it on the decode pod instead; "
                                 "fail = UNAVAILABLE", choices=CHAIN_FAILURE_POLICIES)
    reroute_wait_s: float = setting(30.0, "how long a request that lost its pod, or finds none live, waits "
                                    "for a live decode pod (e.g. the restarted one) before it fails",
                                    minimum=0, maximum=600)
    stall_s: float = setting(30.0, "a streaming client (gRPC or HTTP) that reads nothing for this long "
                             "while its next message waits to be sent is cut off and its request aborted",
                             exclusive_minimum=0)

    def __post_init__(self) -> None:
        require(isinstance(self.chain_break_even, bool),
                f"gateway chain_break_even must be true or false, got {self.chain_break_even!r}")

    def chain_takes_from(self, break_even_tokens: int) -> int:
        """The shortest prompt the gateway sends a chain that advertises ``break_even_tokens``
        (unless the prompt is pinned to a chain)."""
        return max(self.prefill_threshold_tokens,
                   break_even_tokens if self.chain_break_even else 0)
