"""One registry mechanism for every family of swappable parts (after Sarathi-Serve's
``BaseRegistry``): scheduler policies, gateway routing policies, PyramidInfer budget schedules,
and any family added later (KV transports).

A family is declared once, in ``baton.config``, with the names it offers and the module that
holds each implementation; the configuration offers those names as a setting's choices (and
the CRD and values.schema.json as an enum) without importing any implementation. Each
implementation registers itself where it is defined; a lookup imports its module first::

    # baton/config/scheduler.py
    SCHEDULER_POLICIES = Registry("scheduler policy", ("sarathi", "separate", "orca"),
                                  home="baton.sarathi.policies.{module}")
    policy: str = setting("sarathi", "...", choices=SCHEDULER_POLICIES)

    # baton/sarathi/policies/orca.py
    @SCHEDULER_POLICIES.register("orca")
    class OrcaScheduler(Scheduler): ...

    SCHEDULER_POLICIES.get("orca")  # -> OrcaScheduler

A new part is one new module plus its name in the declaration; ``register`` refuses an
undeclared name, and tests/test_registry.py checks that every declared name registers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """The declared names of one family and the implementations registered under them.

    Iterating yields the declared names (so a registry serves as a setting's ``choices``).
    ``home`` is the module holding an implementation; ``{module}`` in it stands for the
    name with ``-`` as ``_`` (one module per implementation).
    """

    def __init__(self, family: str, names: Iterable[str], home: str) -> None:
        self.family = family
        self.names = tuple(names)
        self.home = home
        self._entries: dict[str, T] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, {self.names})"

    def module_of(self, name: str) -> str:
        return self.home.format(module=name.replace("-", "_"))

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator (or plain call) registering an implementation under a declared name."""
        if name not in self.names:
            raise ValueError(f"{self.family} {name!r} is not declared: add it to the names "
                             f"{self.names} where the family is declared (baton.config)")

        def register(entry: T) -> T:
            if self._entries.get(name, entry) is not entry:
                raise ValueError(f"{self.family} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return register

    def get(self, name: str) -> T:
        """The implementation registered under ``name`` (its module is imported first)."""
        if name not in self.names:
            raise ValueError(f"{self.family} {name!r} is not one of {self.names}")
        if name not in self._entries:
            importlib.import_module(self.module_of(name))
        if name not in self._entries:
            raise LookupError(f"{self.family} {name!r}: {self.module_of(name)} registers "
                              f"nothing under that name")
        return self._entries[name]

    def load_all(self) -> dict[str, T]:
        """Every declared name with its implementation (imports every module of the family)."""
        return {name: self.get(name) for name in self.names}
