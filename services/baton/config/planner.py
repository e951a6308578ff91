"""The autoscaling planner (baton.planner): its targets, bounds and how fast it may move."""

from __future__ import annotations

from baton.configtree import require, setting, settings


@settings("planner")
class PlannerConfig:
    """The autoscaling planner (baton.planner): targets, bounds and how fast it may move."""

    ttft_p90_s: float = setting(2.0, "time-to-first-token target: 90% of requests get their first "
                                "token within this many seconds (at the gateway)", exclusive_minimum=0)
    itl_p90_s: float = setting(0.2, "inter-token latency target: 90% of the gaps between a stream's "
                               "tokens are at most this many seconds", exclusive_minimum=0)
    min_decode_pods: int = setting(1, "fewest decode pods the planner keeps", minimum=1)
    max_decode_pods: int = setting(4, "most decode pods the planner asks for", minimum=1)
    min_prefill_chains: int = setting(0, "fewest prefill chains the planner keeps", minimum=0)
    max_prefill_chains: int = setting(2, "most prefill chains the planner asks for", minimum=0)
    interval_s: float = setting(15.0, "seconds between two scrapes of the pods' metrics (and "
                                "two decisions)", exclusive_minimum=0)
    window_s: float = setting(120.0, "the longest stretch of history a decision looks at (load "
                              "must have been low over all of it before a role is lowered)",
                              exclusive_minimum=0)
    scale_up_cooldown_s: float = setting(30.0, "after a role changed size, seconds before it may "
                                         "grow again (the new pods' effect must show first)", minimum=0)
    scale_down_cooldown_s: float = setting(120.0, "a role shrinks only after every decision of "
                                           "this many seconds wanted it smaller, and as long "
                                           "after its last change", minimum=0)
    scale_down_margin: float = setting(0.2, "hysteresis: a role shrinks only when one pod fewer "
                                       "would still meet the targets with this fraction to spare",
                                       minimum=0, exclusive_maximum=1)
    kv_high_fraction: float = setting(0.85, "decode pods' KV pools are sized to stay below this "
                                      "fraction in use", exclusive_minimum=0, maximum=1)
    min_fit_points: int = setting(3, "measurements the performance model needs before it "
                                  "sizes a role (until then only missed targets move it; a line "
                                  "needs two)", minimum=2)

    def __post_init__(self) -> None:
        require(self.min_decode_pods <= self.max_decode_pods,
                f"planner decode pods need 1 <= min ({self.min_decode_pods}) <= max "
                f"({self.max_decode_pods})")
        require(self.min_prefill_chains <= self.max_prefill_chains,
                f"planner prefill chains need 0 <= min ({self.min_prefill_chains}) <= max "
                f"({self.max_prefill_chains})")
        require(self.window_s >= self.interval_s,
                f"planner window_s {self.window_s} must be at least interval_s {self.interval_s}")
