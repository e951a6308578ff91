"""Reading a `BatonService` spec: the helpers every section's reader uses, and the one error
they raise (``InvalidSpec``, naming the bad value). Which key holds which setting is
``baton_operator.fields``."""

from __future__ import annotations

import re
from typing import Any

from baton_operator.fields import spec_values

SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # what Kubernetes allows as a key in a Secret


class InvalidSpec(ValueError):
    """The resource asks for something the operator cannot build (a permanent error)."""


def section_of(spec: dict, name: str) -> dict:
    value = spec.get(name) or {}
    if not isinstance(value, dict):
        raise InvalidSpec(f"spec.{name} must be an object, got {value!r}")
    return value


def build(where: str, cls: type, **values: Any) -> Any:
    """``cls(**values)`` without the unset ones; a ValueError names the spec section."""
    try:
        return cls(**{k: v for k, v in values.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise InvalidSpec(f"spec.{where}: {e}") from e


def values_of(spec: dict, cls: type, section: str | None = None) -> dict[str, Any]:
    """The settings of ``cls`` the spec gives (``baton_operator.fields``), by field name;
    only those under ``section`` when given."""
    try:
        return spec_values(spec, cls, section)
    except TypeError as e:
        raise InvalidSpec(str(e)) from e


def settings_of(spec: dict, where: str, cls: type, section: str | None = None,
              **extra: Any) -> Any:
    """``cls`` built from the settings the spec gives for it; ``extra`` overrides them."""
    return build(where, cls, **{**values_of(spec, cls, section), **extra})


def count_of(section: dict, where: str, key: str, default: int, minimum: int = 0) -> int:
    value = section.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidSpec(f"spec.{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value
