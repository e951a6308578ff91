"""How many decode pods and prefill chains an observed load needs (pure arithmetic).

Decode pods, from the ITL target T (Little's law at the target): a request streams its
E[output] tokens T apart, so the service holds ``rate * E[output] * T`` sequences; one pod
runs ``c*`` of them within T (the fitted ITL line), hence ``pods = that / c*``; requests
queued for admission now come on top (the finished-request rate lags a burst). The KV pools are a second floor:
blocks in use must stay below ``kv_high_fraction`` of the pods' blocks.

Prefill chains, from the TTFT target: prompts at or above the chain threshold (the tail of
the prompt-length distribution, less the prefix-cache hits) arrive at ``rate``; a chain
prefills one at a time in ``S(L) = a + b L`` (the fitted line). Each chain is a queue with
that service time (Pollaczek-Khinchine: mean wait ``lambda E[S^2] / 2(1 - rho)``); the
P90 TTFT is taken as the P90 prompt's own time plus 2.3 mean waits (the P90 of an
exponential wait). The chains' backlog must also drain within T. The fewest chains meeting
both is the answer.

``margin`` tightens the targets (the planner's hysteresis: a role shrinks only if it would
meet them with room to spare).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.config import PlannerConfig
from baton.planner.model import PerformanceModel
from baton.planner.observation import Observation

WAIT_P90_FACTOR = 2.3  # P90 of an exponential wait, in mean waits (ln 10)


@dataclass(frozen=True)
class Need:
    """A role's size for one observation, and why; ``None`` count = the model cannot say."""

    count: int | None
    reason: str


def clamp(count: int, low: int, high: int) -> int:
    return max(low, min(high, count))


def decode_pods(observation: Observation, model: PerformanceModel, config: PlannerConfig,
                margin: float) -> Need:
    target_s = config.itl_p90_s * (1 - margin)
    needs: list[Need] = []
    per_pod_blocks = max((pod.kv_blocks_total for pod in observation.decode), default=0)
    used_blocks = sum(pod.kv_blocks_used for pod in observation.decode)
    if per_pod_blocks > 0:
        room = per_pod_blocks * config.kv_high_fraction * (1 - margin)
        needs.append(Need(math.ceil(used_blocks / room),
                          f"KV use {used_blocks:.0f} blocks, {room:.0f} per pod"))
    per_pod = model.sequences_per_pod(target_s)
    if observation.request_rate_per_s == 0 and observation.decode_queued == 0:
        needs.append(Need(0, "no requests"))
    elif per_pod is None:  # unknown: no size at all, or a KV-only size would shed ITL-bound load
        return Need(None, f"ITL model not fitted yet ({model.itl_points} measurements; "
                          f"it needs {model.min_points}, at two loads at least)")
    elif per_pod == 0:
        needs.append(Need(None, f"a decode pod's ITL with one sequence, "
                                f"{model.itl.at(1):.3f} s, exceeds {target_s:.3f} s: more pods "
                                f"do not lower it"))
    else:
        output_mean = observation.output_tokens.mean
        little = observation.request_rate_per_s * output_mean * target_s
        sequences = little + observation.decode_queued
        count = math.ceil(sequences / per_pod) if math.isfinite(per_pod) else 1
        needs.append(Need(count, f"{observation.request_rate_per_s:.2f} req/s x "
                                 f"{output_mean:.0f} output tokens -> {sequences:.1f} sequences at "
                                 f"ITL {target_s:.3f} s, {per_pod:.1f} per pod"))
    return _most(needs)


def prefill_chains(observation: Observation, model: PerformanceModel, config: PlannerConfig,
                   chain_min_prompt_tokens: int, margin: float) -> Need:
    target_s = config.ttft_p90_s * (1 - margin)
    long = observation.prompt_tokens.above(chain_min_prompt_tokens)
    hit = observation.prefix_hit_rate or 0.0
    rate = long.count / observation.duration_s * (1 - hit) if observation.duration_s > 0 else 0.0
    backlog_tokens = sum(chain.queued_prompt_tokens for chain in observation.chains)
    if rate == 0 and backlog_tokens == 0:
        return Need(0, f"no prompt of {chain_min_prompt_tokens}+ tokens")
    if model.prefill is None:
        if not observation.chains:
            return Need(1, f"{rate:.2f} req/s of {chain_min_prompt_tokens}+ token prompts and "
                           f"no chain to measure")
        return Need(None, f"prefill model not fitted yet ({model.prefill_points} of "
                          f"{model.min_points} measurements)")
    line = model.prefill
    mean_s = line.at(long.mean)
    second_s2 = (line.intercept ** 2 + 2 * line.intercept * line.slope * long.mean
                 + line.slope ** 2 * long.moment(2))
    p90_s = line.at(long.quantile(0.9))
    backlog_s = line.slope * backlog_tokens + line.intercept * sum(
        chain.queued_requests for chain in observation.chains)
    described = (f"{rate:.2f} req/s of {chain_min_prompt_tokens}+ token prompts (P90 "
                 f"{long.quantile(0.9):.0f}), {mean_s:.3f} s each on a chain")
    if p90_s > target_s:
        busy = math.ceil(rate * mean_s / 0.8) if rate else 1
        return Need(busy, f"{described}; the P90 prompt alone takes {p90_s:.3f} s > "
                          f"{target_s:.3f} s: more chains do not help, sized for 80% busy")
    for count in range(1, config.max_prefill_chains + 1):
        busy = rate * mean_s / count
        if busy >= 1 or backlog_s / count > target_s:
            continue
        wait_s = (rate / count) * second_s2 / (2 * (1 - busy))
        if p90_s + WAIT_P90_FACTOR * wait_s <= target_s:
            return Need(count, f"{described}: {count} chain(s) give TTFT P90 "
                               f"~{p90_s + WAIT_P90_FACTOR * wait_s:.3f} s")
    return Need(config.max_prefill_chains + 1,
                f"{described}: even {config.max_prefill_chains} chain(s) miss {target_s:.3f} s")


def _most(needs: list[Need]) -> Need:
    known = [need for need in needs if need.count is not None]
    if not known:
        return Need(None, "; ".join(need.reason for need in needs))
    most = max(known, key=lambda need: need.count)
    return Need(most.count, "; ".join(need.reason for need in needs))
