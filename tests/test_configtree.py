"""``@settings`` enforces every setting's declared choices and bounds, for every class."""

from __future__ import annotations

import dataclasses
import inspect

import baton.config
import pytest
from baton.configtree import is_settings, setting, settings


def test_every_configuration_section_is_declared_with_settings():
    sections = {cls for _, cls in inspect.getmembers(baton.config, inspect.isclass)
                if dataclasses.is_dataclass(cls) and not cls.__name__.endswith("ServiceConfig")}
    assert sections and all(is_settings(cls) for cls in sections), \
        [cls.__name__ for cls in sections if not is_settings(cls)]


@settings("demo")
class Demo:
    mode: str = setting("a", "a mode", choices=("a", "b"))
    count: int = setting(1, "a count", minimum=1)
    ratio: float = setting(0.5, "a ratio", exclusive_minimum=0, maximum=1)
    port: int = setting(0, "a port", minimum=0, maximum=65535)

    def __post_init__(self) -> None:
        self.checked = True


@pytest.mark.parametrize("values, message", [
    ({"mode": "c"}, r"demo mode 'c' is not one of \('a', 'b'\)"),
    ({"count": 0}, "demo count must be >= 1, got 0"),
    ({"ratio": 0.0}, r"demo ratio must be in \(0, 1\], got 0.0"),
    ({"ratio": float("nan")}, r"demo ratio must be in \(0, 1\], got nan"),
    ({"port": 70000}, r"demo port must be in 0..65535, got 70000"),
])
def test_a_value_outside_its_declaration_is_refused_naming_it(values, message):
    with pytest.raises(ValueError, match=message):
        Demo(**values)


def test_the_class_own_checks_run_after_the_declared_ones():
    assert Demo().checked
