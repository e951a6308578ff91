"""Autoscaling: sizes prefill chains and decode pods together from TTFT/ITL targets.

Pure decision code, shared by the operator (on a cluster) and ``baton up --autoscale`` (on
one machine); neither Kubernetes nor a socket is touched here. The pieces, in the order a
decision flows through them:

    samples.py      the pods' /metrics text, parsed      (ClusterScrape)
    observation.py  what happened between two scrapes    (Observation)
    model.py        lines fitted from those measurements (PerformanceModel)
    sizing.py       pods and chains a load needs         (Need)
    planner.py      hysteresis, cool-down, reasons       (Planner, Decision)
    scraper.py      fetching that text over HTTP (the only I/O), for whoever applies them
    trace.py        a live planner's steps recorded, for replaying in tests

docs/operations.md ("Autoscaling") says what it reads and what it will and will not do.
"""

from baton.planner.planner import Decision, Planner, Replicas, RoleDecision
from baton.planner.samples import ClusterScrape, PodScrape, parse_pod

__all__ = ["ClusterScrape", "Decision", "Planner", "PodScrape", "Replicas", "RoleDecision",
           "parse_pod"]
