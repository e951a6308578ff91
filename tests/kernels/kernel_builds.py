"""The kernel tests run on every build this CPU runs (an AVX-512 host tests its AVX2 build
too), each build's module loaded, or built here, by the ``kernels`` fixture: a build that
does not compile fails its tests with the compiler's message (it never skips them)."""

from __future__ import annotations

from types import ModuleType

import pytest
from baton.kernels import cpu as cpu_kernels


def builds_holding(kernel: str) -> list[cpu_kernels.Build]:
    """The builds this CPU runs that hold ``kernel`` (none on a CPU without AVX2)."""
    return [each for each in cpu_kernels.builds_for_this_cpu() if kernel in each.kernels]


def kernels_fixture(kernel: str):
    """A ``kernels`` fixture: the module of each build this CPU runs that holds ``kernel``."""

    @pytest.fixture(params=builds_holding(kernel), ids=lambda build: build.isa)
    def kernels(request) -> ModuleType:
        return cpu_kernels.load(request.param)

    return kernels
