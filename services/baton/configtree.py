"""Turning typed configuration dataclasses into CLI flags and environment variables.

Every setting of baton lives in one nested dataclass tree (`baton.config`). Each
field is declared with ``setting(default, help, choices=..., minimum=...)``: its help
text, and the choices and bounds it takes, which ``@settings`` checks for every class
before the class's own ``__post_init__`` runs (that one keeps only the rules that tie
fields together). This module derives the command-line flags
(``--scheduler-token-budget``) and the environment variables
(``BATON_SCHEDULER_TOKEN_BUDGET``) from that tree, and the operator's schema
generator (``baton_operator.schema``) the CRD and the chart's values from it, so that a
flag, an env var, a Helm value and the code can never disagree about a name, a range
or a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "BATON_"


BOUNDS = ("minimum", "maximum", "exclusive_minimum", "exclusive_maximum")


def setting(default: Any, help: str, *, choices: Any = None, **kwargs: Any) -> Any:
    """A dataclass field with a help string (the one place a setting is documented).

    ``choices`` (a tuple, or a ``baton.registry.Registry`` of a family) and the bounds
    ``minimum``/``maximum`` (inclusive) and ``exclusive_minimum``/``exclusive_maximum``
    are checked by ``@settings`` and become the CLI's choices and the CRD's enum and range.
    """
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    for bound in BOUNDS:
        if bound in kwargs:
            metadata[bound] = kwargs.pop(bound)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def settings(section: str = ""):
    """``@dataclass`` for a configuration class whose declared choices and bounds are checked
    (``check_declared``) before its own ``__post_init__``. ``section`` starts every error
    message (``scheduler token_budget must be ...``): the name the class goes by in a service."""

    def decorate(cls: type[T]) -> type[T]:
        own = cls.__dict__.get("__post_init__")

        def __post_init__(self) -> None:
            check_declared(self)
            if own is not None:
                own(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        cls.__settings_section__ = section  # type: ignore[attr-defined]
        return dataclasses.dataclass(cls)

    return decorate


def is_settings(cls: type) -> bool:
    """Whether ``cls`` was declared with ``@settings`` (its declarations are enforced)."""
    return dataclasses.is_dataclass(cls) and "__settings_section__" in cls.__dict__


def _bounds_text(metadata: typing.Mapping[str, Any]) -> str:
    low = metadata.get("minimum", metadata.get("exclusive_minimum"))
    high = metadata.get("maximum", metadata.get("exclusive_maximum"))
    low_open, high_open = "exclusive_minimum" in metadata, "exclusive_maximum" in metadata
    if low is not None and high is not None:
        if not low_open and not high_open:
            return f"in {low}..{high}"
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"


def _within(value: Any, metadata: typing.Mapping[str, Any]) -> bool:
    """Inside the bounds, and finite (a bound never admits NaN or infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    checks = (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
              ("exclusive_minimum", lambda b: value > b), ("exclusive_maximum", lambda b: value < b))
    return all(check(metadata[bound]) for bound, check in checks if bound in metadata)


def check_declared(config: Any) -> None:
    """Raise ``ValueError`` naming the first field outside its declared choices or bounds."""
    section = getattr(type(config), "__settings_section__", "")
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        label = f"{section} {f.name}" if section else f.name
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{label} {value!r} is not one of {choices}")
        if any(bound in f.metadata for bound in BOUNDS) and not _within(value, f.metadata):
            raise ValueError(f"{label} must be {_bounds_text(f.metadata)}, got {value}")


def _flag_name(prefix: str, name: str) -> str:
    return "--" + (f"{prefix}-{name}" if prefix else name).replace("_", "-")


def _dest(prefix: str, name: str) -> str:
    return (f"{prefix}_{name}" if prefix else name).replace("-", "_")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0])
    return annotation


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_list(item_type: Any):
    def parse(text: str) -> list:
        text = text.strip()
        if not text:
            return []
        return [item_type(part.strip()) for part in text.split(",")]

    return parse


def _converter(annotation: Any):
    annotation = _scalar_type(annotation)
    if annotation is bool:
        return _parse_bool
    if typing.get_origin(annotation) is list:
        (item_type,) = typing.get_args(annotation)
        return _parse_list(item_type)
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"unsupported setting type {annotation!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per leaf field of ``cls`` (nested dataclasses become prefixed groups).

    Defaults are left as ``None`` so that an unset flag falls back to the
    environment variable and then to the dataclass default.
    """
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            add_arguments(parser, annotation, _dest(prefix, f.name))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env = ENV_PREFIX + _dest(prefix, f.name).upper()
        help_text = f.metadata.get("help", "")
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        parser.add_argument(
            _flag_name(prefix, f.name),
            dest=_dest(prefix, f.name),
            type=_converter(annotation),
            default=None,
            choices=f.metadata.get("choices"),
            metavar=None if f.metadata.get("choices") else _scalar_type(annotation).__name__.upper()
            if isinstance(_scalar_type(annotation), type)
            else "LIST",
            # argparse %-formats help: a "90%" in a help string must reach it as "90%%"
            help=f"{help_text} (default: {shown!r}; env {env})".replace("%", "%%"),
        )


def from_arguments(namespace: argparse.Namespace, cls: type[T], prefix: str = "",
                   environ: typing.Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from parsed flags, falling back to ``BATON_*`` env vars, then defaults.

    Validation happens in each class's ``__post_init__`` and raises ``ValueError``.
    """
    environ = os.environ if environ is None else environ
    hints = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        dest = _dest(prefix, f.name)
        if dataclasses.is_dataclass(annotation):
            values[f.name] = from_arguments(namespace, annotation, dest, environ)
            continue
        value = getattr(namespace, dest, None)
        if value is None and (ENV_PREFIX + dest.upper()) in environ:
            raw = environ[ENV_PREFIX + dest.upper()]
            try:
                value = _converter(annotation)(raw)
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{ENV_PREFIX + dest.upper()}={raw!r}: {e}") from e
        if value is not None:
            values[f.name] = value
    return cls(**values)


def flag_names(cls: type, prefix: str = "") -> list[str]:
    """Every flag ``add_arguments`` would create for ``cls`` (used by manifest checks)."""
    names = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            names.extend(flag_names(hints[f.name], _dest(prefix, f.name)))
        else:
            names.append(_flag_name(prefix, f.name))
    return names


def choices_of(cls: type, name: str) -> tuple:
    """The choices a setting declares (for a flag outside the tree that sets it)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds (for ``__post_init__``)."""
    if not condition:
        raise ValueError(message)
