"""The chart's schema files are generated from baton.config (`make schema`), and every
spec key the generator writes is read back by the operator into the setting it names."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from baton.config import HttpConfig, ModelSourceConfig, TensorParallelConfig
from baton.registry import Registry
from baton_operator import schema, workloads
from baton_operator.fields import SPEC_FIELDS, SpecField, camel_case
from baton_operator.spec import read_spec


def test_the_generated_files_are_fresh():
    stale = [str(path.relative_to(schema.ROOT)) for path in schema.stale()]
    assert stale == [], f"{stale} differ from what baton.config generates: run `make schema`"


def _crd_node(spec_field: SpecField) -> dict:
    crd = yaml.safe_load(schema.CRD.read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for name in filter(None, spec_field.section.split(".")):
        node = node["properties"][name]
    return node["properties"][spec_field.key]


@pytest.mark.parametrize("spec_field", [f for f in SPEC_FIELDS if "choices" in f.field.metadata],
                         ids=lambda f: f.path)
def test_the_crd_offers_exactly_the_choices_that_are_implemented(spec_field):
    import baton.config

    enum = _crd_node(spec_field)["enum"]
    assert enum == list(spec_field.field.metadata["choices"])
    families = [value for value in vars(baton.config).values() if isinstance(value, Registry)
                and tuple(value) == tuple(enum)]
    for family in families:  # a policy family: every name the API server admits has a policy
        assert list(family.load_all()) == enum


def test_spec_keys_are_the_settings_names_in_camel_case_with_units_spelled_out():
    assert camel_case("reroute_wait_s") == "rerouteWaitSeconds"
    assert camel_case("kv_memory_mib") == "kvMemoryMiB"
    assert camel_case("kv_link_gb_per_s") == "kvLinkGBPerSecond"
    assert camel_case("stream_interval_ms") == "streamIntervalMs"
    paths = [f.path for f in SPEC_FIELDS]
    assert len(paths) == len(set(paths))


def _another_value(spec_field: SpecField):
    """A value of the setting other than its default that its class accepts."""
    f, default = spec_field.field, schema.default_of(spec_field)
    if "choices" in f.metadata:
        candidates = [c for c in f.metadata["choices"] if c != default]
    elif isinstance(default, bool):
        candidates = [not default]
    elif isinstance(default, str):
        candidates = ["r1"]
    elif isinstance(default, list):
        candidates = [[*default, "r1", "r2"]]
    else:
        candidates = [default + 1, default + 2, default * 2, default / 2, default - 1]
    for value in candidates:
        try:
            spec_field.config(**{spec_field.name: value})
        except ValueError:
            continue
        return value
    raise AssertionError(f"no other value of {spec_field.path}")


def _configs(node):
    if dataclasses.is_dataclass(node):
        yield node
        for f in dataclasses.fields(node):
            yield from _configs(getattr(node, f.name))


@pytest.mark.parametrize("spec_field", SPEC_FIELDS, ids=lambda f: f.path)
def test_the_operator_reads_every_generated_key_into_its_setting(spec_field):
    value = _another_value(spec_field)
    spec: dict = {"mtls": {"insecure": True}}
    node = spec
    for name in filter(None, spec_field.section.split(".")):
        node = node.setdefault(name, {})
    node[spec_field.key] = value
    if spec_field.section in ("prefill", "decode") and spec_field.config is ModelSourceConfig:
        # A role's own limit reaches that role's pods; a chain's is at least the decode pods'.
        spec["decode"] = {"maxModelLen": value}
        read = read_spec(spec, "img")
        role_config = {"prefill": workloads.prefill_config("demo", "ns", read, 0),
                       "decode": workloads.decode_config("demo", "ns", read)}
        assert role_config[spec_field.section].model.max_model_len == value
        return
    if spec_field.config is HttpConfig:  # the gateway's and the decode pods' own, each its role's
        node["enabled"] = True
        role = spec_field.section.split(".")[0]
        assert getattr(getattr(read_spec(spec, "img"), role).http, spec_field.name) == value
        return
    if spec_field.config is TensorParallelConfig:  # each role's own
        assert getattr(read_spec(spec, "img"), spec_field.section).tensor_parallel.size == value
        return
    read = read_spec(spec, "img")
    configs = [c for c in _configs(read) if type(c) is spec_field.config]
    assert configs and all(getattr(c, spec_field.name) == value for c in configs)
