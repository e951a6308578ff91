"""What the SARATHI benchmark measures, as data: a workload, one run's figures, one batch's
iteration costs. ``sarathi.py`` measures them, ``sarathi_report.py`` formats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Workload:
    batch: int  # B: requests in the system at once
    prompt_len: int  # P
    decode_len: int  # D (tokens generated per request, the first one by the prefill)
    budget: int  # C: tokens per iteration
    num_requests: int  # N: requests served in all
    balanced: bool = False  # P:D fills every iteration with one chunk and B-1 decodes

    @property
    def ratio(self) -> float:
        return self.prompt_len / self.decode_len

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.prompt_len, self.decode_len, self.budget, self.num_requests)


@dataclass
class RunStats:
    """One run. Throughputs are taken over the steady-state window: from the moment the
    first B requests have finished (the start-up burst of B prompts at once is over) to the
    arrival of the last request (after which the batch drains and shrinks). Every policy
    ramps up and drains alike; SARATHI's claim is about the steady state in between."""

    policy: str
    workload: Workload
    wall_s: float = 0.0  # the whole run
    window_s: float = 0.0
    window_prompt_tokens: int = 0
    window_decode_tokens: int = 0
    window_decode_s: float = 0.0  # decode-only iterations + what decodes added to mixed ones
    iterations: int = 0
    tbt_s: list[float] = field(default_factory=list)

    @property
    def end_to_end_tps(self) -> float:
        """Prompt and generated tokens computed per second of the window."""
        return (self.window_prompt_tokens + self.window_decode_tokens) / max(self.window_s, 1e-9)

    @property
    def decode_tps(self) -> float:
        """NaN when the attributed decode time is below 1 ms: calibration noise on whole
        prompts (orca) can cancel the decodes' share entirely, and a ratio over ~0 means nothing."""
        if self.window_decode_s < 1e-3:
            return float("nan")
        return self.window_decode_tokens / self.window_decode_s

    @property
    def whole_run_tps(self) -> float:
        w = self.workload
        return w.num_requests * (w.prompt_len + w.decode_len) / self.wall_s

    def tbt_ms(self, percentile: float) -> float:
        return float(np.percentile(self.tbt_s, percentile)) * 1e3 if self.tbt_s else float("nan")


@dataclass
class IterationCosts:
    """Median seconds of the three kinds of iteration, measured back to back on one engine."""

    batch: int
    budget: int
    decode_only_s: float  # B-1 running sequences decode one token each
    mixed_s: float  # the same B-1 decodes plus one chunk of C-(B-1) prompt tokens
    prefill_only_s: float  # that chunk alone (shadow engine)

    @property
    def marginal_s(self) -> float:
        """What the B-1 decodes add to the chunk's iteration."""
        return self.mixed_s - self.prefill_only_s

    @property
    def decode_gain(self) -> float:
        return self.decode_only_s / max(self.marginal_s, 1e-9)

    @property
    def end_to_end_ceiling(self) -> float:
        """The most a balanced workload can gain end to end: separate phases spend the chunk's
        time plus the decodes' own iteration where SARATHI spends one mixed iteration."""
        return (self.prefill_only_s + self.decode_only_s) / self.mixed_s
