"""baton's one configuration tree.

Every knob of every engine and service is a field here, with its help text and
its validation. CLI flags (``--scheduler-token-budget``), environment variables
(``BATON_SCHEDULER_TOKEN_BUDGET``), the operator's container arguments and the
Helm values all derive from these names (see ``baton.configtree``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from baton.configtree import require, setting

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelSourceConfig:
    path: str = setting("", "Hugging Face checkpoint directory; empty means the shipped model")
    revision: str = setting("", "revision label checked against pushed KV caches; empty = directory name")
    dtype: str = setting("auto", "compute dtype: auto = bfloat16 on CUDA, and on a CPU whose bf16 "
                        "matmuls measure faster (AVX512-BF16/AMX), else float32", choices=DTYPES)
    device: str = setting("auto", "auto = cuda when available, else cpu", choices=DEVICES)
    threads: int = setting(0, "torch intra-op threads on CPU; 0 leaves torch's default")

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"model dtype {self.dtype!r} is not one of {DTYPES}")
        require(self.device in DEVICES, f"model device {self.device!r} is not one of {DEVICES}")
        require(self.threads >= 0, f"model threads must be >= 0, got {self.threads}")


@dataclass
class KVPoolConfig:
    block_size: int = setting(16, "tokens per KV block")
    num_blocks: int = setting(0, "KV blocks in the pool; 0 derives it from memory_mib")
    memory_mib: int = setting(512, "memory for the KV pool when num_blocks is 0, in MiB")
    unclaimed_lease_s: float = setting(30.0, "a decode pod frees KV a chain pushed when no Attach claims "
                                       "it within this long (the caller is gone)")
    max_pending_pushes: int = setting(64, "KV uploads a decode pod receives at once; more get "
                                      "RESOURCE_EXHAUSTED (each holds a receive buffer)")
    prefix_cache: bool = setting(True, "keep the KV of prompts' full blocks after their request ends "
                                 "and reuse it for later prompts that start with the same tokens "
                                 "(same tenant, model revision and KV dtype); evicted least "
                                 "recently used when the pool needs room")

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"kv block_size must be >= 1, got {self.block_size}")
        require(self.max_pending_pushes >= 1,
                f"kv max_pending_pushes must be >= 1, got {self.max_pending_pushes}")
        require(math.isfinite(self.unclaimed_lease_s) and self.unclaimed_lease_s > 0,
                f"kv unclaimed_lease_s must be a positive number of seconds, got {self.unclaimed_lease_s}")
        require(self.num_blocks >= 0, f"kv num_blocks must be >= 0, got {self.num_blocks}")
        require(self.memory_mib >= 1, f"kv memory_mib must be >= 1, got {self.memory_mib}")


def registered_policies(*package: str) -> tuple[str, ...]:
    """The policies a registry package holds: one module per policy, so its files are the one
    list of names (read from the file system: importing the package would load the engine)."""
    directory = Path(__file__).parent.joinpath(*package)
    return tuple(sorted(path.stem.replace("_", "-") for path in directory.glob("*.py")
                        if path.stem != "__init__"))


SCHEDULER_POLICIES = registered_policies("sarathi", "policies")


@dataclass
class SchedulerConfig:
    policy: str = setting("sarathi", "sarathi = decode-maximal batches with chunked prefill; "
                          "separate = prefill-only and decode-only iterations; "
                          "orca = whole prefills mixed into decode batches",
                          choices=SCHEDULER_POLICIES)
    token_budget: int = setting(0, "tokens per iteration (decodes + prefill chunks); 0 = auto: the "
                                "largest whose iteration meets target_iteration_ms, timed at start")
    target_iteration_ms: float = setting(200.0, "time-between-tokens target that sizes an auto "
                                         "token budget (SARATHI's rule)")
    tile_size: int = setting(0, "round budget = chunk + decodes down to a multiple of this; 0 = off")
    # vLLM's default too: a burst of requests all start at once (its TTFT), at no cost in
    # throughput where decode attention reads the paged cache in place (baton's CPU kernels).
    max_running: int = setting(256, "most sequences decoding at once")
    step_stall_s: float = setting(120.0, "a decode pod whose engine step has run this long is stuck: it "
                                  "fails its streams UNAVAILABLE (the gateway moves them), leaves "
                                  "routing and exits for its supervisor to restart it; 0 = never")
    cuda_graphs: bool = setting(True, "on a GPU, replay decode-only iterations from CUDA graphs "
                                "(captured per batch and context bucket on first use); no effect "
                                "on a CPU")
    cuda_graph_max_batch: int = setting(256, "the largest decode batch replayed from a CUDA graph")
    cuda_graph_max_context: int = setting(8192, "the longest sequence (tokens) whose decode steps "
                                          "are replayed from a CUDA graph; longer ones run eagerly")

    def __post_init__(self) -> None:
        require(self.policy in SCHEDULER_POLICIES,
                f"scheduler policy {self.policy!r} is not one of {SCHEDULER_POLICIES}")
        require(self.token_budget == 0 or self.token_budget >= 2,
                f"scheduler token_budget must be 0 (auto) or >= 2, got {self.token_budget}")
        require(math.isfinite(self.target_iteration_ms) and self.target_iteration_ms > 0,
                f"scheduler target_iteration_ms must be a finite number > 0, "
                f"got {self.target_iteration_ms}")
        require(self.tile_size >= 0, f"scheduler tile_size must be >= 0, got {self.tile_size}")
        require(math.isfinite(self.step_stall_s) and self.step_stall_s >= 0,
                f"scheduler step_stall_s must be a number >= 0 (0 = never), got {self.step_stall_s}")
        require(self.token_budget == 0 or self.tile_size <= self.token_budget,
                f"scheduler tile_size {self.tile_size} exceeds token_budget {self.token_budget}")
        require(self.max_running >= 1, f"scheduler max_running must be >= 1, got {self.max_running}")
        require(self.cuda_graph_max_batch >= 1,
                f"scheduler cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        require(self.cuda_graph_max_context >= 1,
                f"scheduler cuda_graph_max_context must be >= 1, got {self.cuda_graph_max_context}")


# Implemented by baton.pyramid.schedule.BUDGET_POLICIES (which checks it has exactly these).
PYRAMID_POLICIES = ("pyramid", "uniform", "local")


@dataclass
class PyramidConfig:
    enabled: bool = setting(True, "compress KV caches with PyramidInfer")
    keep_ratio: float = setting(0.5, "target fraction of the full KV cache kept over all layers")
    policy: str = setting("pyramid", "pyramid = per-layer budgets falling with depth, tokens chosen by "
                          "recent-query attention; uniform = same budget in every layer, same "
                          "selector; local = same budget, most recent tokens only (StreamingLLM)",
                          choices=PYRAMID_POLICIES)
    recent_ratio: float = setting(0.2, "recent window: this fraction of the prompt is always kept and scores the rest")
    num_sinks: int = setting(4, "attention-sink tokens at the start always kept")
    min_context: int = setting(64, "a layer that would keep fewer tokens than this keeps all")
    query_weight_min: float = setting(1.0, "weight of the oldest recent-window query")
    query_weight_max: float = setting(1.2, "weight of the newest recent-window query")
    generation_update_every: int = setting(16, "generation phase: re-score after this many tokens leave the window")
    generation_keep_first: float = setting(0.9, "generation phase: keep fraction of each batch at layer 0")
    generation_keep_last: float = setting(0.1, "generation phase: keep fraction of each batch at the last layer")

    def __post_init__(self) -> None:
        require(0.0 < self.keep_ratio <= 1.0, f"pyramid keep_ratio must be in (0, 1], got {self.keep_ratio}")
        require(self.policy in PYRAMID_POLICIES,
                f"pyramid policy {self.policy!r} is not one of {PYRAMID_POLICIES}")
        require(0.0 < self.recent_ratio < 1.0,
                f"pyramid recent_ratio must be in (0, 1), got {self.recent_ratio}")
        require(self.num_sinks >= 0, f"pyramid num_sinks must be >= 0, got {self.num_sinks}")
        require(self.min_context >= 0, f"pyramid min_context must be >= 0, got {self.min_context}")
        require(self.generation_update_every >= 1,
                f"pyramid generation_update_every must be >= 1, got {self.generation_update_every}")
        for name in ("generation_keep_first", "generation_keep_last"):
            value = getattr(self, name)
            require(0.0 < value <= 1.0, f"pyramid {name} must be in (0, 1], got {value}")


# The PushKV stream itself, and NIXL (baton.transfer.nixl).
KV_TRANSPORTS = ("grpc", "nixl")


@dataclass
class KVTransportConfig:
    kind: str = setting("grpc", "the data plane of pushed KV caches: grpc = the PushKV stream "
                        "itself; nixl = NIXL (UCX: RDMA where the cluster has it) for the bytes, "
                        "gRPC for the rest, with any peer that reads over NIXL too (gRPC with the "
                        "others); needs the nixl package (`make nixl`)", choices=KV_TRANSPORTS)
    nixl_read_timeout_s: float = setting(60.0, "a decode pod's NIXL read of a pushed layer or "
                                         "cache taking longer fails the push (DATA_LOSS)")

    def __post_init__(self) -> None:
        require(self.kind in KV_TRANSPORTS,
                f"kv_transport kind {self.kind!r} is not one of {KV_TRANSPORTS}")
        require(math.isfinite(self.nixl_read_timeout_s) and self.nixl_read_timeout_s > 0,
                f"kv_transport nixl_read_timeout_s must be a positive number of seconds, got "
                f"{self.nixl_read_timeout_s}")


RUNAHEAD_MODES = ("runahead", "tsp")
KV_SHIPPING = ("by-layer", "after-prefill")


@dataclass
class ChainConfig:
    ranks: int = setting(2, "processes (GPUs) in a prefill chain")
    rank: int = setting(0, "this process's rank in its chain (the pod ordinal)")
    chain_id: str = setting("chain-0", "name of the chain this process belongs to")
    master_addr: str = setting("127.0.0.1", "rendezvous host: rank 0's address")
    master_port: int = setting(29500, "rendezvous port on rank 0")
    backend: str = setting("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU",
                           choices=("auto", "gloo", "nccl"))
    mode: str = setting("runahead", "runahead = KV-Runahead; tsp = tensor/sequence-parallel baseline",
                        choices=RUNAHEAD_MODES)
    partition_table: str = setting("", "JSON partition table; empty = the shipped default table")
    timeout_s: float = setting(60.0, "a rank waiting longer than this on a peer gives up")
    # What the chain's route costs beyond its compute, for the break-even it advertises
    # (baton.runahead.break_even). The defaults are what this route measured on one host.
    kv_link_gb_per_s: float = setting(1.1, "the rate its KV reaches a decode pod, in GB/s: "
                                      "PushKV's end-to-end rate (1.1 measured on a 2-core "
                                      "host), or the link's with NIXL over RDMA (~11 for "
                                      "100 Gbit/s)")
    extra_hop_ms: float = setting(6.0, "what the chain's route costs a request beyond the "
                                  "decode pod's own prefill besides compute and the KV "
                                  "(one more call; 6 ms measured on one host, ~1 in a cluster)")
    kv_shipping: str = setting("by-layer", "how the tail ships a prompt's KV: by-layer = each "
                               "layer as soon as it is computed, the first token before the "
                               "last layer; after-prefill = the whole cache once the logits "
                               "exist, the first token on its header", choices=KV_SHIPPING)

    def __post_init__(self) -> None:
        require(self.ranks >= 1, f"chain ranks must be >= 1, got {self.ranks}")
        require(self.kv_shipping in KV_SHIPPING,
                f"chain kv_shipping {self.kv_shipping!r} is not one of {KV_SHIPPING}")
        require(0 <= self.rank < self.ranks, f"chain rank {self.rank} is outside 0..{self.ranks - 1}")
        require(1 <= self.master_port <= 65535, f"chain master_port {self.master_port} is not a port")
        require(self.mode in RUNAHEAD_MODES, f"chain mode {self.mode!r} is not one of {RUNAHEAD_MODES}")
        require(self.timeout_s > 0, f"chain timeout_s must be > 0, got {self.timeout_s}")
        require(math.isfinite(self.kv_link_gb_per_s) and self.kv_link_gb_per_s > 0,
                f"chain kv_link_gb_per_s must be a positive rate, got {self.kv_link_gb_per_s}")
        require(math.isfinite(self.extra_hop_ms) and self.extra_hop_ms >= 0,
                f"chain extra_hop_ms must be >= 0, got {self.extra_hop_ms}")


@dataclass
class RoutingConfig:
    redis_url: str = setting("", "Redis URL for routing state; empty = in-memory (one process only)")
    heartbeat_s: float = setting(1.0, "seconds between worker heartbeats")
    worker_ttl_s: float = setting(5.0, "a worker without a heartbeat for this long leaves routing")
    request_ttl_s: float = setting(600.0, "how long the gateway remembers where a request lives")
    prefix_ttl_s: float = setting(60.0, "a decode pod's prefix-cache events and snapshot leave the "
                                  "routing store this long after its last write (a live pod "
                                  "rewrites them at least every third of it)")
    namespace: str = setting("baton", "prefix of every routing key in Redis (one per deployment)")
    redis_timeout_s: float = setting(1.0, "a Redis call taking longer counts as Redis being down")
    view_refresh_s: float = setting(0.5, "the gateway re-reads the workers at most this often")

    def __post_init__(self) -> None:
        require(self.heartbeat_s > 0, f"routing heartbeat_s must be > 0, got {self.heartbeat_s}")
        require(bool(self.namespace) and ":" not in self.namespace,
                f"routing namespace {self.namespace!r} must be non-empty and without ':'")
        require(self.redis_timeout_s > 0,
                f"routing redis_timeout_s must be > 0, got {self.redis_timeout_s}")
        require(self.view_refresh_s >= 0,
                f"routing view_refresh_s must be >= 0, got {self.view_refresh_s}")
        require(self.worker_ttl_s > self.heartbeat_s,
                f"routing worker_ttl_s {self.worker_ttl_s} must exceed heartbeat_s {self.heartbeat_s}")
        require(self.request_ttl_s > 0, f"routing request_ttl_s must be > 0, got {self.request_ttl_s}")
        require(math.isfinite(self.prefix_ttl_s) and self.prefix_ttl_s > 0,
                f"routing prefix_ttl_s must be a positive number of seconds, got {self.prefix_ttl_s}")


@dataclass
class ServerConfig:
    listen: str = setting("127.0.0.1:0", "host:port the gRPC server binds (port 0 = any free port)")
    advertise: str = setting("", "address peers use to reach this server; empty = the bound address")
    metrics_port: int = setting(0, "Prometheus metrics port (/metrics, and /healthz for probes); 0 = off")
    metrics_host: str = setting("127.0.0.1", "address the metrics port binds (the pod's IP in a cluster)")
    grace_s: float = setting(30.0, "seconds in-flight calls get to finish on SIGTERM (a draining pod takes "
                             "nothing new meanwhile)")
    tls_cert: str = setting("", "PEM certificate chain for TLS (e.g. /etc/baton/tls/tls.crt); empty = plaintext")
    tls_key: str = setting("", "PEM private key matching tls_cert (e.g. /etc/baton/tls/tls.key)")
    max_streams: int = setting(4096, "calls the server takes at once (each an event-loop coroutine, not "
                               "a thread); more get RESOURCE_EXHAUSTED")
    max_queued_requests: int = setting(1024, "requests waiting for their prefill (on a decode pod, or in "
                                       "a chain's queue); more get RESOURCE_EXHAUSTED")
    max_message_mib: int = setting(16, "largest message a client may send, in MiB (a KV chunk is ~1 MiB; "
                                   "a text prompt is bounded far below); larger: RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        require(bool(self.tls_cert) == bool(self.tls_key),
                f"tls_cert {self.tls_cert!r} and tls_key {self.tls_key!r} go together: set both or neither")
        require(self.max_streams >= 1, f"max_streams must be >= 1, got {self.max_streams}")
        require(self.max_queued_requests >= 1,
                f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        require(1 <= self.max_message_mib <= 1024,
                f"max_message_mib must be in 1..1024, got {self.max_message_mib}")
        _host, sep, port = self.listen.rpartition(":")
        require(bool(sep) and port.isdigit() and int(port) <= 65535,
                f"listen address {self.listen!r} is not host:port")
        require(0 <= self.metrics_port <= 65535, f"metrics_port {self.metrics_port} is not a port")
        require(self.grace_s >= 0, f"grace_s must be >= 0, got {self.grace_s}")


@dataclass
class MtlsConfig:
    """Mutual TLS between pods (baton.security.mtls): one CA; each pod's certificate names its role."""

    ca: str = setting("", "PEM CA bundle that signs every internal certificate (e.g. "
                      "/etc/baton/mtls/ca.crt)")
    cert: str = setting("", "this pod's PEM certificate, common name baton-<role> (or "
                        "baton-internal), DNS name baton.internal; served and presented as client")
    key: str = setting("", "the PEM private key of cert")
    insecure: bool = setting(False, "plaintext, unauthenticated internal calls (only when asked: a "
                             "service without certificates refuses to start otherwise)")

    def __post_init__(self) -> None:
        given = [bool(self.ca), bool(self.cert), bool(self.key)]
        require(all(given) or not any(given),
                f"mtls ca {self.ca!r}, cert {self.cert!r} and key {self.key!r} go together: set all "
                f"three or none")


GATEWAY_POLICIES = registered_policies("gateway", "policies")
CHAIN_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class GatewayRoutingConfig:
    prefill_threshold_tokens: int = setting(512, "prompts at least this long go through a prefill chain")
    chain_break_even: bool = setting(True, "send a chain only prompts at least as long as its break-even: "
                                     "the length from which its partition table measured it to prefill "
                                     "faster than one process (KV-Runahead's appendix B; the chain "
                                     "advertises it); false = prefill_threshold_tokens alone decides")
    chain_max_queued_tokens: int = setting(4096, "a chain already holding this many prompt tokens not yet "
                                           "prefilled takes no more: the prompt is prefilled on its decode "
                                           "pod instead (a chain prefills one request at a time); 0 = no limit")
    policy: str = setting("cache-aware", "how the gateway picks pods: cache-aware = the decode pod "
                          "with the soonest first token, counting the prompt tokens its prefix "
                          "cache holds, and a chain only for what no pod holds; least-loaded = "
                          "the decode pod with the fewest sequences, then queued prompt tokens, "
                          "then the most free KV blocks (none free = full); both: the chain with "
                          "the fewest queued tokens",
                          choices=GATEWAY_POLICIES)
    kv_wait_s: float = setting(60.0, "how long a decode pod waits for the KV a chain pushes")
    migration_limit: int = setting(3, "times one request's stream moves to another decode pod when its "
                                   "pod fails mid-stream (prompt + tokens sent are replayed there); 0 = never")
    chain_failure: str = setting("recompute", "when a chain fails a request (a rank died, timed out, or its "
                                 "KV push failed): recompute = prefill it on the decode pod instead; "
                                 "fail = UNAVAILABLE", choices=CHAIN_FAILURE_POLICIES)
    reroute_wait_s: float = setting(30.0, "how long a request that lost its pod, or finds none live, waits "
                                    "for a live decode pod (e.g. the restarted one) before it fails")
    stall_s: float = setting(30.0, "a streaming client (gRPC or HTTP) that reads nothing for this long "
                             "while its next message waits to be sent is cut off and its request aborted")

    def __post_init__(self) -> None:
        require(self.migration_limit >= 0, f"gateway migration_limit must be >= 0, got {self.migration_limit}")
        require(self.chain_failure in CHAIN_FAILURE_POLICIES,
                f"gateway chain_failure must be one of {CHAIN_FAILURE_POLICIES}, got {self.chain_failure!r}")
        require(math.isfinite(self.reroute_wait_s) and 0 <= self.reroute_wait_s <= 600,
                f"gateway reroute_wait_s must be in [0, 600] seconds, got {self.reroute_wait_s}")
        require(self.prefill_threshold_tokens >= 1,
                f"gateway prefill_threshold_tokens must be >= 1, got {self.prefill_threshold_tokens}")
        require(isinstance(self.chain_break_even, bool),
                f"gateway chain_break_even must be true or false, got {self.chain_break_even!r}")
        require(self.chain_max_queued_tokens >= 0,
                f"gateway chain_max_queued_tokens must be >= 0, got {self.chain_max_queued_tokens}")
        require(self.policy in GATEWAY_POLICIES,
                f"gateway policy {self.policy!r} is not one of {GATEWAY_POLICIES}")
        require(self.kv_wait_s > 0, f"gateway kv_wait_s must be > 0, got {self.kv_wait_s}")
        require(math.isfinite(self.stall_s) and self.stall_s > 0,
                f"gateway stall_s must be a number > 0, got {self.stall_s}")

    def chain_takes_from(self, break_even_tokens: int) -> int:
        """The shortest prompt the gateway sends a chain that advertises ``break_even_tokens``
        (unless the prompt is pinned to a chain)."""
        return max(self.prefill_threshold_tokens,
                   break_even_tokens if self.chain_break_even else 0)


@dataclass
class StreamConfig:
    interval_ms: float = setting(0.0, "hold each stream's messages at least this far apart; the tokens "
                                 "generated meanwhile go as one message (fewer messages per token: "
                                 "less CPU at the decode pod, the gateway and the client). The first "
                                 "token and a stream's end never wait. 0 = a message every engine step")

    def __post_init__(self) -> None:
        require(math.isfinite(self.interval_ms) and 0 <= self.interval_ms <= 1000,
                f"stream interval_ms must be in 0..1000, got {self.interval_ms}")


@dataclass
class PlannerConfig:
    """The autoscaling planner (baton.planner): targets, bounds and how fast it may move."""

    ttft_p90_s: float = setting(2.0, "time-to-first-token target: 90% of requests get their first "
                                "token within this many seconds (at the gateway)")
    itl_p90_s: float = setting(0.2, "inter-token latency target: 90% of the gaps between a stream's "
                               "tokens are at most this many seconds")
    min_decode_pods: int = setting(1, "fewest decode pods the planner keeps")
    max_decode_pods: int = setting(4, "most decode pods the planner asks for")
    min_prefill_chains: int = setting(0, "fewest prefill chains the planner keeps")
    max_prefill_chains: int = setting(2, "most prefill chains the planner asks for")
    interval_s: float = setting(15.0, "seconds between two scrapes of the pods' metrics (and "
                                "two decisions)")
    window_s: float = setting(120.0, "the longest stretch of history a decision looks at (load "
                              "must have been low over all of it before a role is lowered)")
    scale_up_cooldown_s: float = setting(30.0, "after a role changed size, seconds before it may "
                                         "grow again (the new pods' effect must show first)")
    scale_down_cooldown_s: float = setting(120.0, "a role shrinks only after every decision of "
                                           "this many seconds wanted it smaller, and as long "
                                           "after its last change")
    scale_down_margin: float = setting(0.2, "hysteresis: a role shrinks only when one pod fewer "
                                       "would still meet the targets with this fraction to spare")
    kv_high_fraction: float = setting(0.85, "decode pods' KV pools are sized to stay below this "
                                      "fraction in use")
    min_fit_points: int = setting(3, "measurements the performance model needs before it "
                                  "sizes a role (until then only missed targets move it)")

    def __post_init__(self) -> None:
        for name in ("ttft_p90_s", "itl_p90_s", "interval_s", "window_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0,
                    f"planner {name} must be a number of seconds > 0, got {value}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0,
                    f"planner {name} must be a number of seconds >= 0, got {value}")
        require(1 <= self.min_decode_pods <= self.max_decode_pods,
                f"planner decode pods need 1 <= min ({self.min_decode_pods}) <= max "
                f"({self.max_decode_pods})")
        require(0 <= self.min_prefill_chains <= self.max_prefill_chains,
                f"planner prefill chains need 0 <= min ({self.min_prefill_chains}) <= max "
                f"({self.max_prefill_chains})")
        require(self.window_s >= self.interval_s,
                f"planner window_s {self.window_s} must be at least interval_s {self.interval_s}")
        require(0 <= self.scale_down_margin < 1,
                f"planner scale_down_margin must be in [0, 1), got {self.scale_down_margin}")
        require(0 < self.kv_high_fraction <= 1,
                f"planner kv_high_fraction must be in (0, 1], got {self.kv_high_fraction}")
        require(self.min_fit_points >= 2,
                f"planner min_fit_points must be >= 2 (a line needs two), got {self.min_fit_points}")


@dataclass
class DecodeServiceConfig:
    """`baton decode`: a SARATHI decode worker."""

    server: ServerConfig = field(default_factory=ServerConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    kv: KVPoolConfig = field(default_factory=KVPoolConfig)
    kv_transport: KVTransportConfig = field(default_factory=KVTransportConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pyramid: PyramidConfig = field(default_factory=PyramidConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)


@dataclass
class PrefillServiceConfig:
    """`baton prefill`: one rank of a KV-Runahead prefill chain."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    chain: ChainConfig = field(default_factory=ChainConfig)
    kv_transport: KVTransportConfig = field(default_factory=KVTransportConfig)
    pyramid: PyramidConfig = field(default_factory=PyramidConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)


@dataclass
class HttpConfig:
    """The gateway's OpenAI-compatible HTTP API, beside its gRPC one."""

    host: str = setting("127.0.0.1", "address the HTTP API binds (0.0.0.0 in a pod)")
    port: int = setting(8000, "port of the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /metrics); 0 = off")
    metrics_textfile: str = setting("", "a Prometheus text file (node_exporter's textfile format) "
                                    "whose samples GET /metrics adds to the gateway's own: `baton "
                                    "up --autoscale` writes the planner's targets there; empty = "
                                    "none")

    def __post_init__(self) -> None:
        require(bool(self.host), "http host must not be empty")
        require(0 <= self.port <= 65535, f"http port {self.port} is not a port (0 = off)")


@dataclass
class AuthConfig:
    api_keys_file: str = setting("", "file of API keys clients must present (gRPC `authorization: "
                                 "Bearer KEY` metadata, HTTP Authorization header), one per line "
                                 "as `KEY` or `NAME KEY`; re-read when it changes; empty = no keys")


@dataclass
class GatewayServiceConfig:
    """`baton gateway`: the client-facing router."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    gateway: GatewayRoutingConfig = field(default_factory=GatewayRoutingConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    mtls: MtlsConfig = field(default_factory=MtlsConfig)


@dataclass
class TrainConfig:
    """`baton train`: the shipped small model, trained on the Python standard library."""

    output_dir: str = setting("", "where the checkpoint goes; empty = models/baton-pystdlib")
    corpus_dir: str = setting("", "directory of *.py files; empty = this interpreter's stdlib")
    held_out_percent: int = setting(5, "percent of files (by a hash of their path) held out")
    vocab_size: int = setting(4096, "byte-level BPE vocabulary, end-of-text token included")
    hidden_size: int = setting(256, "model width")
    num_layers: int = setting(4, "decoder layers")
    num_heads: int = setting(8, "query heads")
    num_kv_heads: int = setting(2, "key/value heads (fewer than num_heads: GQA)")
    intermediate_size: int = setting(688, "SwiGLU hidden width")
    context_length: int = setting(1024, "max_position_embeddings and the final training sequence length")
    short_context_length: int = setting(256, "sequence length of the first phase (cheaper attention)")
    short_context_fraction: float = setting(0.7, "fraction of steps trained at short_context_length")
    batch_tokens: int = setting(4096, "tokens per optimizer step (sequences x length)")
    steps: int = setting(2600, "optimizer steps (a fixed count, not a wall-clock budget)")
    warmup_steps: int = setting(60, "linear learning-rate warmup steps")
    learning_rate: float = setting(3e-3, "peak AdamW learning rate (cosine decay after warmup)")
    min_learning_rate: float = setting(1e-4, "learning rate at the end of the cosine")
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices")
    grad_clip: float = setting(1.0, "global gradient-norm clip")
    eval_every: int = setting(200, "steps between held-out evaluations and checkpoint saves")
    eval_windows: int = setting(16, "held-out windows scored at each periodic evaluation (0 = all)")
    seed: int = setting(0, "seed of weights and batch sampling")
    threads: int = setting(2, "torch intra-op threads")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "context_length", "short_context_length", "batch_tokens",
                     "steps", "eval_every", "threads"):
            require(getattr(self, name) >= 1, f"train {name} must be >= 1, got {getattr(self, name)}")
        require(self.vocab_size >= 257,
                f"train vocab_size {self.vocab_size} must exceed 256 (bytes + end-of-text)")
        require(self.hidden_size % self.num_heads == 0,
                f"train hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"train num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        require(self.short_context_length <= self.context_length,
                f"train short_context_length {self.short_context_length} exceeds "
                f"context_length {self.context_length}")
        require(0.0 <= self.short_context_fraction < 1.0,
                f"train short_context_fraction must be in [0, 1), got {self.short_context_fraction}")
        require(self.batch_tokens >= self.context_length,
                f"train batch_tokens {self.batch_tokens} must hold one sequence of "
                f"context_length {self.context_length}")
        require(0 <= self.warmup_steps < self.steps,
                f"train warmup_steps {self.warmup_steps} must be in 0..steps-1 ({self.steps - 1})")
        require(0 < self.min_learning_rate <= self.learning_rate,
                f"train min_learning_rate {self.min_learning_rate} must be in (0, learning_rate "
                f"{self.learning_rate}]")
        require(0 < self.held_out_percent < 100,
                f"train held_out_percent must be in 1..99, got {self.held_out_percent}")
        require(self.weight_decay >= 0, f"train weight_decay must be >= 0, got {self.weight_decay}")
        require(self.grad_clip > 0, f"train grad_clip must be > 0, got {self.grad_clip}")
        require(self.eval_windows >= 0, f"train eval_windows must be >= 0, got {self.eval_windows}")
