"""One registry mechanism for every policy family: the names the configuration declares
(and the CLI, the CRD and values.schema.json offer) are exactly the ones that register."""

from __future__ import annotations

import pytest
from baton.config import GATEWAY_POLICIES, KV_TRANSPORTS, PYRAMID_POLICIES, SCHEDULER_POLICIES
from baton.registry import Registry

FAMILIES = [SCHEDULER_POLICIES, GATEWAY_POLICIES, PYRAMID_POLICIES, KV_TRANSPORTS]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.family)
def test_every_declared_name_registers_an_implementation(family):
    assert list(family.load_all()) == list(family.names)


def test_a_registry_refuses_an_undeclared_or_repeated_name_and_finds_what_registered():
    registry = Registry("test part", ("a-one", "b"), home="baton.registry")
    with pytest.raises(ValueError, match="test part 'c' is not declared"):
        registry.register("c")
    registry.register("a-one")(int)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a-one")(str)
    assert registry.get("a-one") is int and "b" in registry and list(registry) == ["a-one", "b"]
    assert registry.module_of("a-one") == "baton.registry"
    with pytest.raises(LookupError, match="baton.registry registers nothing"):
        registry.get("b")
    with pytest.raises(ValueError, match="'z' is not one of"):
        registry.get("z")
