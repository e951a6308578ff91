"""A decode pod's SARATHI scheduler, and PyramidInfer's KV compression."""

from __future__ import annotations

from baton.configtree import require, setting, settings
from baton.registry import Registry

# One module per policy in baton/sarathi/policies, registered there with @register_policy.
SCHEDULER_POLICIES = Registry("scheduler policy", ("sarathi", "separate", "orca"),
                              home="baton.sarathi.policies.{module}")
# Budget schedules, registered in baton/pyramid/schedule.py.
PYRAMID_POLICIES = Registry("pyramid policy", ("pyramid", "uniform", "local"),
                            home="baton.pyramid.schedule")


@settings("scheduler")
class SchedulerConfig:
    policy: str = setting("sarathi", "sarathi = decode-maximal batches with chunked prefill; "
                          "separate = prefill-only and decode-only iterations; "
                          "orca = whole prefills mixed into decode batches",
                          choices=SCHEDULER_POLICIES)
    token_budget: int = setting(0, "tokens per iteration (decodes + prefill chunks); 0 = auto: the "
                                "largest whose iteration meets target_iteration_ms, timed at start",
                                minimum=0)
    target_iteration_ms: float = setting(200.0, "time-between-tokens target that sizes an auto "
                                         "token budget (SARATHI's rule)", exclusive_minimum=0)
    tile_size: int = setting(0, "round budget = chunk + decodes down to a multiple of this; 0 = off",
                             minimum=0)
    # vLLM's default too: a burst of requests all start at once (its TTFT), at no cost in
    # throughput where decode attention reads the paged cache in place (baton's CPU kernels).
    max_running: int = setting(256, "most sequences decoding at once", minimum=1)
    step_stall_s: float = setting(120.0, "a decode pod whose engine step has run this long is stuck: it "
                                  "fails its streams UNAVAILABLE (the gateway moves them), leaves "
                                  "routing and exits for its supervisor to restart it; 0 = never",
                                  minimum=0)
    cuda_graphs: bool = setting(True, "on a GPU, replay decode-only iterations from CUDA graphs "
                                "(captured per batch and context bucket on first use); no effect "
                                "on a CPU")
    cuda_graph_max_batch: int = setting(256, "the largest decode batch replayed from a CUDA graph",
                                        minimum=1)
    cuda_graph_max_context: int = setting(8192, "the longest sequence (tokens) whose decode steps "
                                          "are replayed from a CUDA graph; longer ones run eagerly",
                                          minimum=1)

    def __post_init__(self) -> None:
        require(self.token_budget == 0 or self.token_budget >= 2,
                f"scheduler token_budget must be 0 (auto) or >= 2, got {self.token_budget}")
        require(self.token_budget == 0 or self.tile_size <= self.token_budget,
                f"scheduler tile_size {self.tile_size} exceeds token_budget {self.token_budget}")


@settings("pyramid")
class PyramidConfig:
    enabled: bool = setting(True, "compress KV caches with PyramidInfer")
    keep_ratio: float = setting(0.5, "target fraction of the full KV cache kept over all layers",
                                exclusive_minimum=0, maximum=1)
    policy: str = setting("pyramid", "pyramid = per-layer budgets falling with depth, tokens chosen by "
                          "recent-query attention; uniform = same budget in every layer, same "
                          "selector; local = same budget, most recent tokens only (StreamingLLM)",
                          choices=PYRAMID_POLICIES)
    recent_ratio: float = setting(0.2, "recent window: this fraction of the prompt is always kept and "
                                  "scores the rest", exclusive_minimum=0, exclusive_maximum=1)
    num_sinks: int = setting(4, "attention-sink tokens at the start always kept", minimum=0)
    min_context: int = setting(64, "a layer that would keep fewer tokens than this keeps all", minimum=0)
    query_weight_min: float = setting(1.0, "weight of the oldest recent-window query")
    query_weight_max: float = setting(1.2, "weight of the newest recent-window query")
    generation_update_every: int = setting(16, "generation phase: re-score after this many tokens leave "
                                           "the window", minimum=1)
    generation_keep_first: float = setting(0.9, "generation phase: keep fraction of each batch at layer 0",
                                           exclusive_minimum=0, maximum=1)
    generation_keep_last: float = setting(0.1, "generation phase: keep fraction of each batch at the "
                                          "last layer", exclusive_minimum=0, maximum=1)
