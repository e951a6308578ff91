"""The planner: scrapes in, replica counts for prefill chains and decode pods out, with reasons.

    observe(scrape)  -> keep the scrapes of the last window, fit the model on the newest interval
    decide(current)  -> size both roles on the newest interval and on the whole window
                        (sizing.py), correct by the targets actually missed, then settle:

* up: to the larger of the two sizings at once, unless the role changed less than
  ``scale_up_cooldown_s`` ago (the last change's effect must show first);
* down: one pod (or chain) at a time, only when even with ``scale_down_margin`` to spare
  both sizings want fewer (hysteresis), have wanted fewer at every decision for
  ``scale_down_cooldown_s``, and the role has not changed for as long; a chain only when
  the one that would go is idle (no queued request);
* a missed target the model did not foresee (observed TTFT or ITL P90 above target at the
  gateway while the model says the current size suffices) adds one to the role that owns
  it: ITL and TTFT of locally prefilled prompts to decode, TTFT of chain prompts to prefill.

Time comes from the injected ``clock`` (seconds); nothing here sleeps, reads a socket or
touches Kubernetes. The operator and ``baton up --autoscale`` apply the decisions.

``snapshot()`` / ``restore()`` carry what outlives a process (the model's measurements, each
role's last change and since when it has wanted fewer) as plain data, so an operator that
restarts keeps its cool-downs and its model; the scrapes are not kept (counters are read
afresh: a restored planner decides again after two scrapes).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from baton.config import PlannerConfig
from baton.planner import sizing
from baton.planner.model import PerformanceModel
from baton.planner.observation import GATEWAY_TTFT, Observation, distribution, merge, observe
from baton.planner.samples import ClusterScrape, chain_order

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class Replicas:
    prefill_chains: int
    decode_pods: int

    def of(self, role: str) -> int:
        return self.prefill_chains if role == "prefill" else self.decode_pods


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    target: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.target != self.current


@dataclass(frozen=True)
class Decision:
    time_s: float
    prefill: RoleDecision
    decode: RoleDecision
    drain_decode_pod: str = ""  # the decode pod to remove first (the fewest sequences running)

    @property
    def target(self) -> Replicas:
        return Replicas(self.prefill.target, self.decode.target)

    @property
    def changed(self) -> bool:
        return self.prefill.changed or self.decode.changed

    def roles(self) -> tuple[RoleDecision, RoleDecision]:
        return self.prefill, self.decode


@dataclass
class _RoleState:
    last_change_s: float = -math.inf
    lower_since_s: float | None = None  # since when every decision wanted fewer


class Planner:
    def __init__(self, config: PlannerConfig, chain_min_prompt_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.chain_min_prompt_tokens = chain_min_prompt_tokens
        self.clock = clock
        self.model = PerformanceModel(min_points=config.min_fit_points)
        self._scrapes: deque[ClusterScrape] = deque()
        self._roles = {"prefill": _RoleState(), "decode": _RoleState()}

    def snapshot(self) -> dict:
        """What a successor needs, JSON-ready, with times as ages on this planner's clock."""
        now = self.clock()

        def ages(state: _RoleState) -> dict:
            # An age never set is left out rather than null: a merge patch deletes nulls.
            since = {"secondsSinceChange": state.last_change_s,
                     "wantedFewerForSeconds": state.lower_since_s}
            return {name: round(now - t, 3) for name, t in since.items()
                    if t is not None and t != -math.inf}

        return {"version": SNAPSHOT_VERSION, "model": self.model.snapshot(),
                "roles": {role: ages(state) for role, state in self._roles.items()}}

    def restore(self, saved: dict, elapsed_s: float) -> None:
        """Continue from ``snapshot()``'s ``saved``, taken ``elapsed_s`` ago. A change happened
        that much longer ago; wanting fewer resumes where it stopped, since nobody watched
        the load in between. Raises ValueError (and keeps its own state) on anything else."""
        try:
            if saved["version"] != SNAPSHOT_VERSION:
                raise ValueError(f"snapshot version {saved['version']!r}, expected "
                                 f"{SNAPSHOT_VERSION}")
            model = PerformanceModel(min_points=self.config.min_fit_points)
            model.restore(saved["model"])
            ages = {role: (saved["roles"][role].get("secondsSinceChange"),
                           saved["roles"][role].get("wantedFewerForSeconds"))
                    for role in self._roles}
            for since_change, wanted_fewer in ages.values():
                for value in (since_change, wanted_fewer):
                    if value is not None and not (math.isfinite(value) and value >= 0):
                        raise ValueError(f"an age of {value!r} seconds")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a planner snapshot: {e!r}") from e
        if not (math.isfinite(elapsed_s) and elapsed_s >= 0):
            raise ValueError(f"elapsed_s must be a number of seconds >= 0, got {elapsed_s}")
        now = self.clock()
        self.model = model
        for role, (since_change, wanted_fewer) in ages.items():
            state = self._roles[role]
            state.last_change_s = -math.inf if since_change is None else \
                now - since_change - elapsed_s
            state.lower_since_s = None if wanted_fewer is None else now - wanted_fewer

    def observe(self, scrape: ClusterScrape) -> None:
        if self._scrapes and scrape.time_s <= self._scrapes[-1].time_s:
            raise ValueError(f"scrape at {scrape.time_s} is not after {self._scrapes[-1].time_s}")
        if self._scrapes:
            self.model.learn(observe(self._scrapes[-1], scrape))
        self._scrapes.append(scrape)
        while scrape.time_s - self._scrapes[0].time_s > self.config.window_s:
            self._scrapes.popleft()

    def decide(self, current: Replicas) -> Decision:
        now = self.clock()
        if len(self._scrapes) < 2:
            hold = "waiting for a second scrape"
            return Decision(now, RoleDecision("prefill", current.prefill_chains,
                                              current.prefill_chains, hold),
                            RoleDecision("decode", current.decode_pods, current.decode_pods, hold))
        recent = observe(self._scrapes[-2], self._scrapes[-1])
        window = observe(self._scrapes[0], self._scrapes[-1])
        decode = self._settle("decode", current.decode_pods, now,
                              *self._decode_needs(recent, window))
        prefill = self._settle("prefill", current.prefill_chains, now,
                               *self._prefill_needs(recent, window),
                               removable=self._last_chain_idle(recent))
        drain = min(recent.decode, key=lambda pod: (pod.running_sequences, pod.pod), default=None)
        return Decision(now, prefill, decode, drain.pod if drain and decode.target <
                        current.decode_pods else "")

    # --- sizing --------------------------------------------------------------------------

    def _decode_needs(self, recent: Observation, window: Observation):
        config = self.config
        up = [sizing.decode_pods(o, self.model, config, 0.0) for o in (recent, window)]
        down = [sizing.decode_pods(o, self.model, config, config.scale_down_margin)
                for o in (recent, window)]
        missed = []
        itl_p90 = recent.itl.quantile(0.9)
        if recent.itl.count and itl_p90 > config.itl_p90_s:
            missed.append(f"ITL P90 {itl_p90:.3f} s > target {config.itl_p90_s:.3f} s")
        local_ttft = self._ttft("local")
        if local_ttft > config.ttft_p90_s:
            missed.append(f"TTFT P90 of prompts prefilled on decode pods {local_ttft:.3f} s > "
                          f"target {config.ttft_p90_s:.3f} s")
        return up, down, missed, config.min_decode_pods, config.max_decode_pods

    def _prefill_needs(self, recent: Observation, window: Observation):
        config, threshold = self.config, self.chain_min_prompt_tokens
        up = [sizing.prefill_chains(o, self.model, config, threshold, 0.0) for o in (recent, window)]
        down = [sizing.prefill_chains(o, self.model, config, threshold, config.scale_down_margin)
                for o in (recent, window)]
        missed = []
        chain_ttft = self._ttft("chain")
        if chain_ttft > config.ttft_p90_s:
            missed.append(f"TTFT P90 of chain prompts {chain_ttft:.3f} s > target "
                          f"{config.ttft_p90_s:.3f} s")
        return up, down, missed, config.min_prefill_chains, config.max_prefill_chains

    def _ttft(self, path: str) -> float:
        """Observed TTFT P90 of one path over the newest interval (0 when none finished)."""
        newer, older = self._scrapes[-1], self._scrapes[-2].by_name()
        return merge([distribution(g, older.get(g.pod), GATEWAY_TTFT, path=path)
                      for g in newer.of_role("gateway")]).quantile(0.9)

    def _last_chain_idle(self, recent: Observation) -> tuple[bool, str]:
        chains = sorted(recent.chains, key=lambda chain: chain_order(chain.chain))
        if not chains:
            return True, ""
        last = chains[-1]  # the operator and the supervisor remove the last chain
        return last.idle, f"chain {last.chain} still has {last.queued_requests:.0f} queued"

    # --- hysteresis and cool-down -----------------------------------------------------------

    def _settle(self, role: str, current: int, now: float, up: list[sizing.Need],
                down: list[sizing.Need], missed: list[str], low: int, high: int,
                removable: tuple[bool, str] = (True, "")) -> RoleDecision:
        state, config = self._roles[role], self.config
        if not low <= current <= high:  # the bounds were changed under it: into them at once
            bound = sizing.clamp(current, low, high)
            return self._change(role, current, bound, now, f"{current} is outside the bounds "
                                f"{low}..{high}")
        known_up = [need.count for need in up if need.count is not None]
        wanted_up = sizing.clamp(max(known_up) if known_up else current, low, high)
        reason = "; ".join(dict.fromkeys(need.reason for need in up))
        if missed and wanted_up <= current and current < high:
            wanted_up, reason = current + 1, f"{'; '.join(missed)} (model: {reason})"
        since_change = now - state.last_change_s
        if wanted_up > current:
            state.lower_since_s = None
            if since_change < config.scale_up_cooldown_s:
                return RoleDecision(role, current, current, f"cool-down ({since_change:.0f} of "
                                    f"{config.scale_up_cooldown_s:.0f} s) holds {wanted_up}: "
                                    f"{reason}")
            return self._change(role, current, wanted_up, now, reason)
        known_down = [need.count for need in down]
        wanted_down = current if None in known_down else sizing.clamp(max(known_down), low, high)
        if missed or wanted_down >= current:
            state.lower_since_s = None
            return RoleDecision(role, current, current, f"hold: {reason}")
        if state.lower_since_s is None:
            state.lower_since_s = now
        waited = min(now - state.lower_since_s, since_change)
        down_reason = "; ".join(dict.fromkeys(need.reason for need in down))
        if waited < config.scale_down_cooldown_s:
            return RoleDecision(role, current, current, f"{wanted_down} would do for "
                                f"{waited:.0f} of {config.scale_down_cooldown_s:.0f} s: "
                                f"{down_reason}")
        idle, busy = removable
        if not idle:
            return RoleDecision(role, current, current, f"{busy}: not removed until idle")
        return self._change(role, current, current - 1, now,
                            f"{wanted_down} would do with {config.scale_down_margin:.0%} to "
                            f"spare: {down_reason}")

    def _change(self, role: str, current: int, target: int, now: float, reason: str) -> RoleDecision:
        state = self._roles[role]
        state.last_change_s, state.lower_since_s = now, None
        return RoleDecision(role, current, target, reason)
