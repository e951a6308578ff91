"""The planner's performance model, fitted from the pods' own measurements (no constants).

Two straight lines, refitted after every scrape:

    decode   ITL P90 of a pod  = itl_base_s + itl_per_sequence_s * sequences streaming on it
             (one point per decode pod per scrape interval that streamed enough tokens)
    prefill  compute seconds of one prompt = prefill_base_s + prefill_per_token_s * tokens
             (one point per chain per scrape interval that prefilled something)

A decode iteration's time grows with its batch (every running sequence adds its attention
and its share of the budget), which is what the first line captures; a chain prefills one
prompt at a time, in time growing with its length.

Points are kept in bins along x (half-octaves: sequences, or prompt tokens), each an
exponentially weighted mean, so what was learnt at a load the service no longer runs at is
remembered rather than pushed out by many points at today's load: a slope needs points at
different loads, and a quiet hour must not forget what a busy one taught. The line is a
weighted least-squares fit over the bins. With one bin only, a prefill line goes through
the origin (time proportional to tokens: prefill is nearly linear in them); a decode line
stays unknown (at one load the intercept and the slope cannot be told apart, and guessing
either way scales wrongly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.planner.observation import Observation

MIN_ITL_SAMPLES = 20  # gaps a pod must have streamed in an interval for its P90 to count
BIN_WEIGHT_CAP = 5.0  # a bin counts at most this many points' worth in the fit
EWMA_ALPHA = 0.3  # weight of a new point in its bin


@dataclass(frozen=True)
class Line:
    """y = intercept + slope * x, fitted over ``num_bins`` bins."""

    intercept: float
    slope: float
    num_bins: int

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass
class _Bin:
    x: float
    y: float
    weight: float = 1.0

    def add(self, x: float, y: float) -> None:
        self.x += EWMA_ALPHA * (x - self.x)
        self.y += EWMA_ALPHA * (y - self.y)
        self.weight = min(BIN_WEIGHT_CAP, self.weight + 1)


class BinnedPoints:
    """Measurements (x, y) kept as one moving mean per half-octave of x."""

    def __init__(self) -> None:
        self.bins: dict[int, _Bin] = {}
        self.num_points = 0

    def add(self, x: float, y: float) -> None:
        key = round(2 * math.log2(1 + x))
        if key in self.bins:
            self.bins[key].add(x, y)
        else:
            self.bins[key] = _Bin(x, y)
        self.num_points += 1

    def snapshot(self) -> dict:
        """What was learnt, as JSON-ready plain data (``restore`` reads it back). Bins stay in
        the order they were made: the fit sums in that order, so a restored line is the
        same to the last bit."""
        return {"points": self.num_points,
                "bins": [[key, b.x, b.y, b.weight] for key, b in self.bins.items()]}

    @classmethod
    def restore(cls, saved: dict) -> BinnedPoints:
        points = cls()
        points.num_points = int(saved["points"])
        for key, x, y, weight in saved["bins"]:
            points.bins[int(key)] = _Bin(float(x), float(y), float(weight))
        return points

    def fit(self, through_origin_when_one_bin: bool) -> Line | None:
        """Weighted least squares with a non-negative intercept (a negative one: through the
        origin); None while y has not been seen to grow with x (a slope <= 0 is noise)."""
        bins = list(self.bins.values())
        if not bins:
            return None
        total = sum(b.weight for b in bins)
        mean_x = sum(b.weight * b.x for b in bins) / total
        mean_y = sum(b.weight * b.y for b in bins) / total
        if len(bins) >= 2:
            var_x = sum(b.weight * (b.x - mean_x) ** 2 for b in bins)
            slope = sum(b.weight * (b.x - mean_x) * (b.y - mean_y) for b in bins) / var_x
            if slope <= 0:
                return None
            if mean_y - slope * mean_x >= 0:
                return Line(mean_y - slope * mean_x, slope, len(bins))
        elif not through_origin_when_one_bin:
            return None
        sum_xx = sum(b.weight * b.x * b.x for b in bins)
        slope = sum(b.weight * b.x * b.y for b in bins) / sum_xx if sum_xx > 0 else 0.0
        return Line(0.0, slope, len(bins))


class PerformanceModel:
    def __init__(self, min_points: int = 3) -> None:
        self.min_points = min_points
        self._itl = BinnedPoints()
        self._prefill = BinnedPoints()
        self.itl: Line | None = None
        self.prefill: Line | None = None

    def learn(self, observation: Observation) -> None:
        """Add one scrape interval's measurements and refit."""
        for pod in observation.decode:
            if pod.whole_interval and pod.itl.count >= MIN_ITL_SAMPLES and pod.mean_sequences > 0:
                self._itl.add(pod.mean_sequences, pod.itl.quantile(0.9))
        for chain in observation.chains:
            if chain.prompts > 0 and chain.compute_s > 0:
                self._prefill.add(chain.prompt_tokens / chain.prompts, chain.compute_s / chain.prompts)
        self.itl = self._fit(self._itl, through_origin_when_one_bin=False)
        self.prefill = self._fit(self._prefill, through_origin_when_one_bin=True)

    def snapshot(self) -> dict:
        """The measurements behind both lines (not the lines: they are refitted on restore)."""
        return {"decodeItl": self._itl.snapshot(), "prefill": self._prefill.snapshot()}

    def restore(self, saved: dict) -> None:
        """Take back what ``snapshot`` saved, as if this model had learnt it itself."""
        self._itl = BinnedPoints.restore(saved["decodeItl"])
        self._prefill = BinnedPoints.restore(saved["prefill"])
        self.itl = self._fit(self._itl, through_origin_when_one_bin=False)
        self.prefill = self._fit(self._prefill, through_origin_when_one_bin=True)

    def _fit(self, points: BinnedPoints, through_origin_when_one_bin: bool) -> Line | None:
        if points.num_points < self.min_points:
            return None
        return points.fit(through_origin_when_one_bin)

    @property
    def itl_points(self) -> int:
        return self._itl.num_points

    @property
    def prefill_points(self) -> int:
        return self._prefill.num_points

    def sequences_per_pod(self, itl_s: float) -> float | None:
        """Sequences one decode pod runs with its ITL P90 at ``itl_s`` (None: not fitted yet;
        0: not even one sequence meets it; inf: ITL does not grow with load)."""
        if self.itl is None:
            return None
        if self.itl.slope == 0:
            return math.inf if self.itl.intercept <= itl_s else 0.0
        return max(0.0, (itl_s - self.itl.intercept) / self.itl.slope)

    def describe(self) -> dict:
        """The fitted lines, for the status of a BatonService and the logs."""
        result: dict = {"decodeItlPoints": self.itl_points, "prefillPoints": self.prefill_points}
        if self.itl is not None:
            result.update(decodeItlBaseSeconds=round(self.itl.intercept, 6),
                          decodeItlPerSequenceSeconds=round(self.itl.slope, 6))
        if self.prefill is not None:
            result.update(prefillBaseSeconds=round(self.prefill.intercept, 6),
                          prefillPerTokenSeconds=round(self.prefill.slope, 9))
        return result
