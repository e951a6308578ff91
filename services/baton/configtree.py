"""Turning typed configuration dataclasses into CLI flags and environment variables.

Every setting of baton lives in one nested dataclass tree (`baton.config`). Each
field carries its help text in ``field(metadata={"help": ...})`` and each class
validates itself in ``__post_init__``. This module derives the command-line
flags (``--scheduler-token-budget``) and the environment variables
(``BATON_SCHEDULER_TOKEN_BUDGET``) from that tree, so that a flag, an env var, a
Helm value and the code can never disagree about a name or a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "BATON_"


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a help string (the one place a setting is documented)."""
    metadata = {"help": help}
    if "choices" in kwargs:
        metadata["choices"] = kwargs.pop("choices")
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


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


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds (for ``__post_init__``)."""
    if not condition:
        raise ValueError(message)
