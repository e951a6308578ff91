"""A live planner's inputs and outputs, recorded so that tests can replay a real run.

    header  {"trace": 1, "config": PlannerConfig's fields, "chainMinPromptTokens": n}
    step    {"time_s": t, "current": [chains, decode pods],
             "pods": [[pod, role, chain, {series: [[labels, value], ...]}], ...],
             "decision": {"prefill": [target, reason], "decode": [target, reason],
                          "drain": pod}}

One JSON line each, gzipped when the path ends in ``.gz``. Only the series the planner
reads are kept (``observation.PLANNER_SERIES``), not a pod's whole ``/metrics``.
``baton up --autoscale --planner-trace PATH`` writes one; ``read_trace`` reads it back and
``replay`` runs a fresh planner over it on the recorded clock.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from baton.config import PlannerConfig
from baton.planner.observation import PLANNER_SERIES
from baton.planner.planner import Decision, Planner, Replicas
from baton.planner.samples import ClusterScrape, PodScrape

TRACE_VERSION = 1


@dataclass(frozen=True)
class TraceStep:
    scrape: ClusterScrape
    current: Replicas  # the sizes the planner was told before deciding
    prefill: tuple[int, str]  # (target, reason) as decided live
    decode: tuple[int, str]
    drain: str


@dataclass(frozen=True)
class Trace:
    config: PlannerConfig
    chain_min_prompt_tokens: int
    steps: tuple[TraceStep, ...]


def _open(path: Path, mode: str) -> IO[str]:
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def _kept(name: str) -> bool:
    return any(name == series or name.startswith(f"{series}_") for series in PLANNER_SERIES)


class TraceWriter:
    """Appends one line per decision; each line is flushed, so a killed run keeps its steps."""

    def __init__(self, path: Path, config: PlannerConfig, chain_min_prompt_tokens: int) -> None:
        self._file = _open(Path(path), "w")
        self._write({"trace": TRACE_VERSION, "config": dataclasses.asdict(config),
                     "chainMinPromptTokens": chain_min_prompt_tokens})

    def write(self, scrape: ClusterScrape, current: Replicas, decision: Decision) -> None:
        pods = [[pod.pod, pod.role, pod.chain,
                 {name: [[list(map(list, labels)), value] for labels, value in series.items()]
                  for name, series in pod.samples.items() if _kept(name)}]
                for pod in scrape.pods]
        self._write({"time_s": scrape.time_s,
                     "current": [current.prefill_chains, current.decode_pods], "pods": pods,
                     "decision": {"prefill": [decision.prefill.target, decision.prefill.reason],
                                  "decode": [decision.decode.target, decision.decode.reason],
                                  "drain": decision.drain_decode_pod}})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _records(path: Path) -> Iterator[dict]:
    with _open(Path(path), "r") as file:
        for line in file:
            if line.strip():
                yield json.loads(line)


def read_trace(path: Path) -> Trace:
    records = _records(path)
    header = next(records, None)
    if not header or header.get("trace") != TRACE_VERSION:
        raise ValueError(f"{path} is not a planner trace (version {TRACE_VERSION})")
    steps = []
    for record in records:
        pods = tuple(PodScrape(pod, role, chain, {
            name: {tuple(map(tuple, labels)): value for labels, value in series}
            for name, series in samples.items()}) for pod, role, chain, samples in record["pods"])
        decision = record["decision"]
        steps.append(TraceStep(ClusterScrape(record["time_s"], pods), Replicas(*record["current"]),
                               tuple(decision["prefill"]), tuple(decision["decode"]),
                               decision["drain"]))
    return Trace(PlannerConfig(**header["config"]), header["chainMinPromptTokens"], tuple(steps))


def replay(trace: Trace, config: PlannerConfig | None = None) -> list[Decision]:
    """A fresh planner (``config``, or the recorded one) over the recorded scrapes, told the
    recorded sizes at the recorded times: one decision per step."""
    clock = [0.0]
    planner = Planner(config or trace.config, trace.chain_min_prompt_tokens, lambda: clock[0])
    decisions = []
    for step in trace.steps:
        clock[0] = step.scrape.time_s
        planner.observe(step.scrape)
        decisions.append(planner.decide(step.current))
    return decisions
