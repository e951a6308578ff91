"""Which ``baton.config`` settings a `BatonService` spec carries, and under which keys.

One table, read by the operator (``spec.py`` builds the configuration dataclasses from
these keys) and by the schema generator (``schema.py`` writes their type, enum, bounds,
default and help into the CRD and the chart's values). A key is the setting's name in
camelCase, with units spelled the Kubernetes way (``reroute_wait_s`` ->
``rerouteWaitSeconds``, ``memory_mib`` -> ``MiB``); a section may add a prefix
(``decode.kvMemoryMiB`` is ``KVPoolConfig.memory_mib``). Only names that truly differ are
listed as exceptions (``ranks`` -> ``ranksPerChain``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from baton.config import (
    ChainConfig,
    GatewayRoutingConfig,
    HttpConfig,
    KVCacheConfig,
    KVPoolConfig,
    KVTransportConfig,
    LogConfig,
    ModelSourceConfig,
    OtlpConfig,
    PlannerConfig,
    PyramidConfig,
    SchedulerConfig,
    StreamConfig,
    TensorParallelConfig,
)

# Unit suffixes of snake_case names and how a Kubernetes field spells them (longest first).
UNITS = (("gb_per_s", "GBPerSecond"), ("mib", "MiB"), ("s", "Seconds"))


def camel_case(snake: str) -> str:
    """``kv_memory_mib`` -> ``kvMemoryMiB``; ``reroute_wait_s`` -> ``rerouteWaitSeconds``."""
    unit = ""
    for suffix, spelled in UNITS:
        if snake.endswith("_" + suffix):
            snake, unit = snake[: -len(suffix) - 1], spelled
            break
    first, *rest = snake.split("_")
    return first + "".join(word[:1].upper() + word[1:] for word in rest) + unit


@dataclass(frozen=True)
class SpecField:
    """One setting in the spec: ``spec.<section>.<key>`` is ``<config>.<name>``."""

    section: str  # dotted path of the object holding it; "" = spec itself
    key: str
    config: type
    name: str
    schema: dict  # the CRD's own narrowing of the setting's range, or its own description

    @property
    def path(self) -> str:
        return f"{self.section}.{self.key}" if self.section else self.key

    @property
    def field(self) -> dataclasses.Field:
        return next(f for f in dataclasses.fields(self.config) if f.name == self.name)


def section(path: str, config: type, *names: str, prefix: str = "",
            keys: dict[str, str] | None = None,
            schema: dict[str, dict] | None = None) -> list[SpecField]:
    keys, schema = keys or {}, schema or {}
    return [SpecField(path, keys.get(name) or camel_case(f"{prefix}_{name}" if prefix else name),
                      config, name, schema.get(name, {})) for name in names]


SPEC_FIELDS: list[SpecField] = [
    *section("model", ModelSourceConfig, "revision", "dtype", "served_model_name", "max_model_len"),
    *section("prefill", ChainConfig, "ranks", "mode", "kv_link_gb_per_s", "extra_hop_ms",
             keys={"ranks": "ranksPerChain"}, schema={"ranks": {"maximum": 64}}),
    # A role's own limit on model.max_model_len (0 = model.maxModelLen).
    *[SpecField(role, "maxModelLen", ModelSourceConfig, "max_model_len", {"description": (
        f"the longest sequence the {role} pods serve; 0 = model.maxModelLen")})
      for role in ("prefill", "decode")],
    *section("decode", SchedulerConfig, "token_budget", "max_running", "policy", "cuda_graphs"),
    *section("decode", KVPoolConfig, "memory_mib", "memory_fraction", "block_size", prefix="kv"),
    *section("decode", KVPoolConfig, "prefix_cache"),
    *section("decode", StreamConfig, "interval_ms", prefix="stream"),
    # each decode pod, each chain rank: this many ranks, one per device (gpu.perPod each)
    *[spec_field for role in ("prefill", "decode")
      for spec_field in section(role, TensorParallelConfig, "size", keys={"size": "tensorParallelSize"},
                                schema={"size": {"maximum": 64}})],
    *section("compression", PyramidConfig, "enabled", "keep_ratio", "recent_ratio", "num_sinks",
             "min_context"),
    *section("routing", GatewayRoutingConfig, "policy", "prefill_threshold_tokens",
             "chain_break_even", "chain_max_queued_tokens", "migration_limit", "chain_failure",
             "reroute_wait_s"),
    # Port 0 (off) is spelled `enabled: false` in the spec.
    *section("gateway.http", HttpConfig, "port", schema={"port": {"minimum": 1}}),
    *section("decode.http", HttpConfig, "port", schema={"port": {"minimum": 1, "description": (
        "port of each decode pod's own OpenAI HTTP API (with decode.http.enabled)")}}),
    *section("autoscaling", PlannerConfig, "ttft_p90_s", "itl_p90_s", "interval_s",
             "scale_up_cooldown_s", "scale_down_cooldown_s",
             schema={"interval_s": {"minimum": 1}}),  # a scrape a second at most
    *section("autoscaling.decode", PlannerConfig, "min_decode_pods", "max_decode_pods",
             keys={"min_decode_pods": "minReplicas", "max_decode_pods": "maxReplicas"}),
    *section("autoscaling.prefill", PlannerConfig, "min_prefill_chains", "max_prefill_chains",
             keys={"min_prefill_chains": "minChains", "max_prefill_chains": "maxChains"}),
    *section("", KVTransportConfig, "kind", keys={"kind": "kvTransport"}),
    # The KV cache's bytes (FP8 or the compute dtype): one setting for the chains and the
    # decode pods, which must agree (the KV contract).
    *section("kvCache", KVCacheConfig, "dtype", "scale"),
    # Every pod's logs and traces (docs/operations.md, "Traces and logs").
    *section("logging", LogConfig, "level", "format", "requests"),
    *section("tracing", OtlpConfig, "traces_endpoint", keys={"traces_endpoint": "otlpTracesEndpoint"}),
]


def spec_values(spec: dict, config: type, under: str | None = None) -> dict[str, Any]:
    """Field name -> value of every setting of ``config`` the spec gives (absent ones left
    out), only those under the section ``under`` when given (a setting a role may override).

    Raises ``TypeError`` naming a section that is not an object."""
    values = {}
    for spec_field in SPEC_FIELDS:
        if spec_field.config is not config or under not in (None, spec_field.section):
            continue
        node: Any = spec
        for name in filter(None, spec_field.section.split(".")):
            node = node.get(name) or {}
            if not isinstance(node, dict):
                raise TypeError(f"spec.{spec_field.section} must be an object, got {node!r}")
        if node.get(spec_field.key) is not None:
            values[spec_field.name] = node[spec_field.key]
    return values
