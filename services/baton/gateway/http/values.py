"""Reading one field of a JSON request body: its type checked, a BadParameter naming it when
it is not what the field takes."""

from __future__ import annotations

import math

from baton.gateway.http.fields import BadParameter, short


def json_object(value: object, what: str) -> dict:
    """``value`` as an object; BadParameter naming the field ``what`` starts with."""
    if not isinstance(value, dict):
        param = "" if what.startswith("the ") else what.split(".")[0]
        raise BadParameter(param, f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def strings(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(item, str) and item for item in value)):
        raise BadParameter(name, f"{name} must be a string or a list of non-empty strings, got "
                                 f"{short(value)}")
    return value


def optional_text(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadParameter(name, f"{name} must be a string, got {short(value)}")
    return value or None


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(body: dict, name: str, default, minimum: int | None = None,
             maximum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise BadParameter(name, f"{name} must be an integer, got {short(value)}")
    if minimum is not None and value < minimum:
        raise BadParameter(name, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise BadParameter(name, f"{name} must be <= {maximum}, got {value}")
    return value


def number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not math.isfinite(value):
        raise BadParameter(name, f"{name} must be a finite number, got {short(value)}")
    return float(value)


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParameter(name, f"{name} must be true or false, got {short(value)}")
    return value
