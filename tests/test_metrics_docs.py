"""Every metric docs/operations.md names exists: the pods' registries, rendered in-process,
export it (a recipe that reads a series nobody exports scales on nothing)."""

from __future__ import annotations

import re
from pathlib import Path

from baton.metrics import DecodeMetrics, GatewayMetrics, PlannerMetrics, PrefillMetrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
# baton_* and vllm:* names; not the operator's package, nor a bare prefix in a regex
METRIC_NAME = re.compile(r"(?<![\w:])(?!baton_operator)(?:baton_|vllm:)[a-z0-9_:]*[a-z0-9]")


def exported_names() -> set[str]:
    """Family and sample names of every role's registry, as a scraper reads them."""
    names = set()
    for role in (DecodeMetrics, PrefillMetrics, GatewayMetrics):
        names |= rendered(role(CollectorRegistry(), "m").registry)
    return names | rendered(PlannerMetrics(CollectorRegistry()).registry)


def rendered(registry) -> set[str]:
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    return ({family.name for family in families}
            | {sample.name for family in families for sample in family.samples}
            | {family.name + "_total" for family in families if family.type == "counter"})


def test_every_metric_the_operations_guide_names_is_exported():
    named = set(METRIC_NAME.findall(OPERATIONS.read_text()))
    assert {"vllm:num_requests_waiting", "baton_decode_running_sequences"} <= named
    assert sorted(named - exported_names()) == []
